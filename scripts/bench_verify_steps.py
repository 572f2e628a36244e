"""Device time of one step of each kind speculative decoding runs, on the embedded default model.

Each warmed-up executable runs on an all-padding batch of its shape (median of 30 runs, the
sampled tokens fetched each time): a plain engine's decode step; an ngram engine's verify
step (k + 1 tokens per sequence); an MTP engine's decode step with no sequence speculating
(the module skipped), with speculating ones without and with drafting for the next step, and
its verify step (drafting). Engines as a user gets them but for
`max_model_len` (512) and `num_speculative_tokens` (`--k`, 2).

Usage (from the repository root):
  PYTHONPATH=. python scripts/bench_verify_steps.py --batch-sizes 1 16
"""

import argparse
import dataclasses
import statistics
import time

import numpy as np

from jaxengine import LLM
from jaxengine.engine.batch_builder import Shape
from jaxengine.run_config import DEFAULT_MODEL


def step_ms(llm: LLM, shape: Shape, drafting: bool, runs: int = 30, speculating: bool | None = None) -> float:
    """`speculating`: whether the batch's sequences speculate (default: when `drafting`)."""
    engine = llm.engine
    batch, sampling = engine.builder.empty(shape)
    speculating = drafting if speculating is None else speculating
    sampling = dataclasses.replace(sampling, wants_drafts=np.full_like(sampling.wants_drafts, drafting),
                                   speculates=np.full_like(sampling.speculates, speculating))
    executable = engine.runner.executable(batch, sampling, decode=shape.decode)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out, engine.runner.draft_pools, engine.runner.pools = engine.runner.run_executable(executable, batch, sampling)
        np.asarray(out.tokens)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--k", type=int, default=2)
    args = parser.parse_args()
    engine_args = dict(max_model_len=512, max_num_seqs=max(args.batch_sizes), warm_up=False,
                       compilation_cache_dir=None)
    plain = LLM(DEFAULT_MODEL, **engine_args)
    ngram = LLM(DEFAULT_MODEL, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **engine_args)
    mtp = LLM(DEFAULT_MODEL, speculative_config={"method": "mtp", "num_speculative_tokens": args.k}, **engine_args)
    print("seqs | plain decode | ngram verify | MTP decode, none speculating | MTP decode | MTP decode, drafting "
          "| MTP verify, drafting (ms)")
    for n in args.batch_sizes:
        decode = next(s for s in plain.engine.shapes() if s.decode and s.num_seqs == n and s.sample_width == 1)
        verify = next(s for s in mtp.engine.shapes() if s.decode and s.num_seqs == n and s.sample_width > 1)
        times = (step_ms(plain, decode, False), step_ms(ngram, verify, False), step_ms(mtp, decode, False),
                 step_ms(mtp, decode, False, speculating=True), step_ms(mtp, decode, True), step_ms(mtp, verify, True))
        print(f"{n:4d} | " + " | ".join(f"{t:.2f}" for t in times))


if __name__ == "__main__":
    main()
