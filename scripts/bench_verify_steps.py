"""Device time of one step of each kind speculative decoding runs, on the embedded default model.

Each warmed-up executable runs on an all-padding batch of its shape (median of 30 runs, the
sampled tokens fetched each time): a plain engine's decode step; an ngram engine's verify
step (k + 1 tokens per sequence); an MTP engine's decode step with no sequence speculating
(a shape without the module), with speculating ones without and with drafting for the next
step, and its verify step (drafting). Engines as a user gets them but for
`max_model_len` (512) and `num_speculative_tokens` (`--k`, 2).

`--mixed-tokens T` also times the plain and the MTP engine's mixed step of T tokens at each
batch size, sampled at temperature 0.7 (top-p 0.95) with no sequence speculating (the MTP
engine's shape without the module): the two executables called alternately (median of 60
each), as what speculation that does not run still costs a mixed step.

Usage (from the repository root):
  PYTHONPATH=. python scripts/bench_verify_steps.py --batch-sizes 1 16
  PYTHONPATH=. python scripts/bench_verify_steps.py --batch-sizes 16 --mixed-tokens 512
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
    sampling = dataclasses.replace(
        sampling,
        wants_drafts=np.full_like(sampling.wants_drafts, drafting),
        speculates=np.full_like(sampling.speculates, speculating),
    )
    executable = engine.runner.executable(batch, sampling, decode=shape.decode)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out, engine.runner.draft_pools, engine.runner.pools = engine.runner.run_executable(executable, batch, sampling)
        np.asarray(out.tokens)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def mixed_ms(engines: list[LLM], num_tokens: int, num_seqs: int, runs: int = 60) -> list[float]:
    """Each engine's mixed step of `num_tokens` tokens and `num_seqs` sequences on an
    all-padding batch sampled at temperature 0.7, the engines' executables called in turn."""
    steps = []
    for llm in engines:
        engine = llm.engine
        shape = next(
            s
            for s in engine.shapes()
            if not s.decode
            and not s.runs_drafter
            and (s.num_tokens, s.num_seqs, s.sample_width) == (num_tokens, num_seqs, 1)
        )
        batch, sampling = engine.builder.empty(shape)
        sampling = dataclasses.replace(
            sampling, temperature=np.full_like(sampling.temperature, 0.7), top_p=np.full_like(sampling.top_p, 0.95)
        )
        steps.append((engine.runner, engine.runner.executable(batch, sampling, decode=False), batch, sampling))
    times = [[] for _ in engines]
    for i in range(runs):
        for j in range(len(steps)) if i % 2 else reversed(range(len(steps))):
            runner, executable, batch, sampling = steps[j]
            start = time.perf_counter()
            out, runner.draft_pools, runner.pools = runner.run_executable(executable, batch, sampling)
            np.asarray(out.tokens)
            times[j].append(time.perf_counter() - start)
    return [1e3 * statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--mixed-tokens", type=int, default=None, help="also time mixed steps of this many tokens")
    args = parser.parse_args()
    engine_args = dict(max_model_len=512, max_num_seqs=max(args.batch_sizes), warm_up=False, compilation_cache_dir=None)
    plain = LLM(DEFAULT_MODEL, **engine_args)
    ngram = LLM(DEFAULT_MODEL, speculative_config={"method": "ngram", "num_speculative_tokens": args.k}, **engine_args)
    mtp = LLM(DEFAULT_MODEL, speculative_config={"method": "mtp", "num_speculative_tokens": args.k}, **engine_args)
    print(
        "seqs | plain decode | ngram verify | MTP decode, none speculating | MTP decode | MTP decode, drafting "
        "| MTP verify, drafting (ms)"
    )
    for n in args.batch_sizes:
        decode = next(s for s in plain.engine.shapes() if s.decode and s.num_seqs == n and s.sample_width == 1)
        verify = next(s for s in mtp.engine.shapes() if s.decode and s.num_seqs == n and s.sample_width > 1)
        with_module = dataclasses.replace(decode, runs_drafter=True)
        times = (
            step_ms(plain, decode, False),
            step_ms(ngram, verify, False),
            step_ms(mtp, decode, False),
            step_ms(mtp, with_module, False, speculating=True),
            step_ms(mtp, with_module, True),
            step_ms(mtp, verify, True),
        )
        print(f"{n:4d} | " + " | ".join(f"{t:.2f}" for t in times))
    if args.mixed_tokens:
        print(f"seqs | plain mixed step, {args.mixed_tokens} tokens | MTP mixed step, no drafts (ms)")
        for n in args.batch_sizes:
            print(f"{n:4d} | " + " | ".join(f"{t:.2f}" for t in mixed_ms([plain, mtp], args.mixed_tokens, n)))


if __name__ == "__main__":
    main()
