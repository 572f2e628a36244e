"""Many callers on one `LLM`: threads calling `generate` at once, against one caller.

    python scripts/bench_concurrency.py [--threads 8] [--calls 25] [--prompt-len 32] [--max-tokens 16]

The same requests (one prompt per call, greedy, the embedded default model) run three ways:
one thread calling `generate` once per request; `--threads` threads each calling it for
their share at once (whichever holds the engine's lock steps for all, so their requests
share steps); and one `generate` call with every prompt (the batched ideal). Reports wall
time and requests/s of each, and checks that every way gives the same tokens.
"""

import argparse
import json
import threading
import time

import numpy as np

from jaxengine import LLM, SamplingParams
from jaxengine.run_config import DEFAULT_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--calls", type=int, default=25, help="calls per thread")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--json", default="bench_concurrency.json")
    args = parser.parse_args()
    llm = LLM(
        DEFAULT_MODEL,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=args.threads,
        max_num_batched_tokens=max(256, args.threads * args.prompt_len),
        compilation_cache_dir=None,
    )
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.threads * args.calls)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # settle

    def fresh(batch: list[list[int]]) -> list[list[int]]:
        """Salted per run, so no run is served from the cache of an earlier one."""
        return [{"prompt_token_ids": p, "cache_salt": salt} for p in batch]

    results = {}
    salt = "one-by-one"
    start = time.perf_counter()
    one_by_one = [llm.generate(fresh([p]), params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    results["one thread, one call per request"] = time.perf_counter() - start

    salt = "threads"
    threaded: list = [None] * len(prompts)

    def caller(t: int) -> None:
        for i in range(t, len(prompts), args.threads):
            threaded[i] = llm.generate(fresh([prompts[i]]), params, use_tqdm=False)[0].outputs[0].token_ids

    start = time.perf_counter()
    workers = [threading.Thread(target=caller, args=(t,)) for t in range(args.threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    results[f"{args.threads} threads at once"] = time.perf_counter() - start

    salt = "batched"
    start = time.perf_counter()
    batched = [o.outputs[0].token_ids for o in llm.generate(fresh(prompts), params, use_tqdm=False)]
    results["one call with every prompt"] = time.perf_counter() - start

    assert one_by_one == threaded == batched, "the three ways gave different tokens"
    for name, wall in results.items():
        print(f"{name:<36} {wall:7.2f} s  {len(prompts) / wall:7.1f} requests/s")
    with open(args.json, "w") as f:
        json.dump({"settings": vars(args), "wall_s": results, "requests": len(prompts)}, f, indent=2)


if __name__ == "__main__":
    main()
