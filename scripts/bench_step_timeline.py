"""Where an engine step's time goes on the embedded default model, at its default settings:
the host's part before dispatch, the dispatch, the wait for the device, the host's part
after, and the device's idle gap between steps (`llm.stats()`, `step_timeline.py`), for
decode at several batch sizes.

    python scripts/bench_step_timeline.py [--batch-sizes 1 16] [--max-tokens 128]
"""

import argparse
import json
import time

from jaxengine import LLM, SamplingParams
from jaxengine.run_config import DEFAULT_MODEL

KEYS = (
    "step_host_before_ms",
    "step_dispatch_ms",
    "step_device_wait_ms",
    "step_host_after_ms",
    "step_device_idle_gap_ms",
    "device_idle_fraction",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    results = {}
    for batch in args.batch_sizes:
        llm = LLM(DEFAULT_MODEL, background_compile=False)  # every shape ready: no step compiles
        prompts = [f"def function_{i}(x):" for i in range(batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)  # each shape's first run
        llm.engine.timeline.reset()  # only the measured run's steps
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        stats = llm.stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        results[batch] = {"output_tokens_per_s": tokens / seconds, **{k: stats[k] for k in KEYS}}
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[batch].items()), flush=True)
        llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
