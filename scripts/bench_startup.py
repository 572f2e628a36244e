"""Cold start-up of the embedded default model as a user starts it, with no stored steps:
`LLM()` ready (the largest shapes compiled), the first 16 tokens out, and every shape
compiled (the rest on the background threads), with the compile threads this machine gives.
Run it under `taskset -c 0`, `-c 0,1`, ... to see start-up against the number of cores.

    taskset -c 0 python scripts/bench_startup.py
"""

import time

from jaxengine import LLM, SamplingParams
from jaxengine.engine.step_executables import background_threads, compile_threads
from jaxengine.run_config import DEFAULT_MODEL


def main() -> None:
    start = time.perf_counter()
    llm = LLM(DEFAULT_MODEL, compilation_cache_dir=None)
    ready = time.perf_counter() - start
    llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - start
    steps = llm.engine.runner.steps
    steps.wait()
    every = time.perf_counter() - start
    print(
        f"cores {compile_threads()} (background threads {background_threads()}): LLM() {ready:.1f} s, "
        f"16 tokens out {first:.1f} s, all {len(steps.ready)} shapes {every:.1f} s, "
        f"compile seconds summed {sum(steps.compile_seconds.values()):.1f}"
    )


if __name__ == "__main__":
    main()
