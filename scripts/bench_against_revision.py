"""This checkout's engine against an earlier revision of itself, at the defaults a user gets:
output tokens/s of greedy decode on the embedded default model, batch by batch.

Two versions of one package cannot share a process, so each runs in processes of its own
(the revision from a `git worktree` of it), the two taking turns `--pairs` times so that
the machine's drift falls on both alike; each process compiles or loads every step shape
first (no background compile; one persistent compilation cache per version, so only the
first process of each compiles), warms up, then times `--runs` generates. Reported: the
median tokens/s of each version and the median of the per-pair ratios (this checkout over
the revision), and where the version keeps a step timeline (`llm.stats()`), the host's
milliseconds per step before dispatch and in all (before, dispatching, and after the step's
tokens are read: what the device must cover for the host never to hold it up; medians).
`--prompt-tokens N` gives each sequence a prompt of N token ids instead of a short text;
`--repetition-penalty` applies one. `--max-model-len N` and `--max-num-seqs N` set those
engine arguments (defaults: the engine's); a `--max-model-len` beyond the default model's
2,048 positions runs a copy of it whose `max_position_embeddings` is N (its rotary embedding
takes any position). `--synchronous` turns async scheduling off in both versions (a revision
without it fails): the host then works while the device waits, so its milliseconds are its
own, not slowed by a step running beside it on the same cores.

    python scripts/bench_against_revision.py --revision f927afe [--batch-sizes 16] \
        [--max-tokens 256] [--pairs 8] [--runs 3] [--prompt-tokens N] \
        [--repetition-penalty 1.1] [--max-model-len N] [--max-num-seqs N] [--synchronous] [--json OUT]
"""

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

from revision_worktree import REPO, median_ratio, revision_worktree, run_worker, take_turns

DEFAULT_MODEL = REPO / "jaxengine" / "assets" / "default_model"  # `jaxengine.run_config.DEFAULT_MODEL`

# Runs under either version: only the offline API both have (`LLM`, `SamplingParams`,
# `generate`; the step timeline where there is one); prints one JSON line per batch size:
# tokens/s and the host's milliseconds per step, before dispatch and in all (None without a
# timeline).
WORKER = """
import json, statistics, sys, time
from jaxengine import LLM, SamplingParams
cache, max_tokens, runs, prompt_tokens, penalty, model, max_model_len, max_num_seqs, sync, *batches = sys.argv[1:]
engine_args = {k: int(v) for k, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)) if int(v)}
if int(sync):
    engine_args["async_scheduling"] = False
llm = LLM(model, background_compile=False, compilation_cache_dir=cache, **engine_args)
params = SamplingParams(
    max_tokens=int(max_tokens), temperature=0, ignore_eos=True, repetition_penalty=float(penalty)
)
timeline = getattr(llm.engine, "timeline", None)


def prompts(batch, run):
    if int(prompt_tokens) == 0:
        return [f"def function_{i}(x):" for i in range(batch)]
    # distinct prompts in every run: no prefix-cache hits between runs
    return [{"prompt_token_ids": [1 + (run * 7919 + i * 104729 + j) % 4000 for j in range(int(prompt_tokens))]}
            for i in range(batch)]


result = {}
for batch in map(int, batches):
    llm.generate(prompts(batch, 0), params, use_tqdm=False)  # warm-up
    rates, host, host_all = [], [], []
    for run in range(1, int(runs) + 1):
        if timeline is not None:
            timeline.reset()
        start = time.perf_counter()
        outs = llm.generate(prompts(batch, run), params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        if timeline is not None:
            stats = llm.stats()
            host.append(stats["step_host_before_ms"])
            host_all.append(sum(stats[k] for k in ("step_host_before_ms", "step_dispatch_ms", "step_host_after_ms")))
    result[batch] = {
        "tokens_per_s": statistics.median(rates),
        "host_before_ms": statistics.median(host) if host else None,
        "host_ms": statistics.median(host_all) if host_all else None,
    }
print("RESULT " + json.dumps(result))
"""


def run_version(source: Path, cache: Path, model: Path, args: argparse.Namespace) -> dict[int, dict]:
    """One process of the version at `source`: per batch size, its median tokens/s and host
    milliseconds per step (before dispatch, and in all)."""
    worker_args = [str(cache), str(args.max_tokens), str(args.runs), str(args.prompt_tokens)]
    worker_args += [str(args.repetition_penalty), str(model), str(args.max_model_len), str(args.max_num_seqs)]
    worker_args.append(str(int(args.synchronous)))
    return run_worker(source, WORKER, worker_args + [str(b) for b in args.batch_sizes])


def model_for(max_model_len: int, tmp: Path) -> Path:
    """The default model, or a copy of it with room for `max_model_len` positions."""
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    if max_model_len <= config["max_position_embeddings"]:
        return DEFAULT_MODEL
    copy = tmp / "model"
    shutil.copytree(DEFAULT_MODEL, copy)
    (copy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": max_model_len}, indent=2))
    return copy


def _median_or_none(values) -> float | None:
    """The median of the values, or None where a version has no step timeline."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="a git revision of this repository")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3, help="timed generates per process")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="prompt length in tokens (0: a short text)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--max-model-len", type=int, default=0, help="engine argument (0: the engine's default)")
    parser.add_argument("--max-num-seqs", type=int, default=0, help="engine argument (0: the engine's default)")
    parser.add_argument("--synchronous", action="store_true", help="async scheduling off in both versions")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    with revision_worktree(args.revision) as base, tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        sources = {"this checkout": REPO, args.revision: base}
        caches = {name: tmp / f"cache-{i}" for i, name in enumerate(sources)}
        model = model_for(args.max_model_len, tmp)
        rates = take_turns(sources, args.pairs, lambda name, source: run_version(source, caches[name], model, args))
    results = {}
    for batch in args.batch_sizes:
        ours = [r[batch]["tokens_per_s"] for r in rates["this checkout"]]
        theirs = [r[batch]["tokens_per_s"] for r in rates[args.revision]]
        results[batch] = {
            "this_checkout_tokens_per_s": statistics.median(ours),
            "revision_tokens_per_s": statistics.median(theirs),
            "ratio": median_ratio(ours, theirs),
            "this_checkout_host_before_ms": _median_or_none(r[batch]["host_before_ms"] for r in rates["this checkout"]),
            "revision_host_before_ms": _median_or_none(r[batch]["host_before_ms"] for r in rates[args.revision]),
            "this_checkout_host_ms": _median_or_none(r[batch].get("host_ms") for r in rates["this checkout"]),
            "revision_host_ms": _median_or_none(r[batch].get("host_ms") for r in rates[args.revision]),
        }
        print(
            f"batch {batch}: this checkout {results[batch]['this_checkout_tokens_per_s']:.1f} tok/s, "
            f"{args.revision} {results[batch]['revision_tokens_per_s']:.1f} tok/s, "
            f"ratio {results[batch]['ratio']:.3f} (median of {args.pairs} pairs); host ms before dispatch "
            f"{_ms(results[batch]['this_checkout_host_before_ms'])} / {_ms(results[batch]['revision_host_before_ms'])}, "
            f"in all {_ms(results[batch]['this_checkout_host_ms'])} / {_ms(results[batch]['revision_host_ms'])}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"revision": args.revision, **vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
