"""Prefix-cache token hit rate per memory budget: jaxengine's bookkeeping beside Marconi's.

    python scripts/bench_prefix_replay.py [--marconi-dir PATH] [--budgets-gb 1 2 4 8 16] \
        [--model-config configs/models/nemotron-h-7b-shape] [--out-dir bench_replay] [--json OUT.json]

Builds three traces with `make_prefix_trace.py` (seed 0):
  conversations  40 conversations x 6 turns, a 512-token first message, then 64-token answers
                 and 64-token messages; 37 open at a time in round-robin, so about 33 other
                 requests come between two turns of one conversation;
  system-prompt  a 1,024-token system prompt and 32 questions of 10-40 tokens;
  few-shot       a 256-token instruction, 4 families x 4 tasks of 256 + 256 example tokens,
                 200 requests picking a task at random.
and replays each through `replay_prefix_trace.py` at every budget with retention `dense`
(the default), `sparse` and `every=256`, KV in bfloat16, SSM states in `--state-dtype`
(bfloat16 by default, as Marconi counts them; the engine's checkpoints keep float32
precision, twice the bytes). With `--marconi-dir`
(a checkout of github.com/ruipeterpan/marconi; it needs scipy and transformers) the same
traces and budgets also run through Marconi's simulator: V1 (SGLang+, LRU), V2 (Marconi:
alpha tuned online on a bootstrap window) and the best static alpha over 0, 0.1, ..., 2 (V3,
an offline oracle), with its default model, the 7B hybrid this config describes. Marconi's
simulator counts hits at token granularity and counts the last output token of a turn as
cached; the engine (and the replay) caches full pages of computed tokens only.
"""

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import make_prefix_trace  # noqa: E402
import replay_prefix_trace  # noqa: E402

TRACES = {
    "conversations": ["conversations", "--conversations", "40", "--turns", "6", "--system-tokens", "0",
                      "--first-message-tokens", "512", "512", "--message-tokens", "64", "64",
                      "--output-tokens", "64", "64", "--max-active", "37"],
    "system-prompt": ["system-prompt", "--system-tokens", "1024", "--questions", "32"],
    "few-shot": ["few-shot"],
}
RETENTIONS = ("dense", "sparse", "every=256")
ALPHAS = [round(0.1 * i, 1) for i in range(21)]


def ours(trace: Path, model_config: Path, budget: float, retention: str, state_dtype: str) -> float:
    with contextlib.redirect_stdout(io.StringIO()):
        result = replay_prefix_trace.main([str(trace), "--model-config", str(model_config), "--budget-bytes",
                                           str(budget), "--kv-dtype", "bfloat16", "--state-dtype", state_dtype,
                                           "--retention", retention])
    return result["token_hit_rate"]


def marconi(radix_cache, trace: list[dict], budget: float, version: int, alpha: float) -> float:
    """Token hit rate of Marconi's simulator (its own replay loop) on `trace`."""
    tree = radix_cache(capacity_bytes=budget, evict_policy_version=version, eff_weight=alpha, use_logical_ts=True,
                       num_ssm_layers=24, num_attn_layers=4, num_mlp_layers=28, d=4096, n=128)
    with contextlib.redirect_stdout(io.StringIO()):
        for request in trace:
            tree.match_prefix(request["input_tokens"])
            tree.insert(token_ids=request["input_tokens"] + request["output_tokens"],
                        state_at_leaf=request["session_id"], state_at_branchoff=request["session_id"])
        return tree.get_cache_stats(verbose=False)[1]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--marconi-dir", type=Path, help="a checkout of ruipeterpan/marconi")
    parser.add_argument("--budgets-gb", type=float, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--model-config", type=Path,
                        default=Path(__file__).parent.parent / "configs" / "models" / "nemotron-h-7b-shape")
    parser.add_argument("--state-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="SSM states in checkpoints (bfloat16 as Marconi counts them; the engine keeps float32)")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_replay"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    radix_cache = None
    if args.marconi_dir:
        sys.path.insert(0, str(args.marconi_dir))
        from radix_cache_hybrid import RadixCache as radix_cache  # noqa: N813
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, spec in TRACES.items():
        path = args.out_dir / f"{name}.jsonl"
        with contextlib.redirect_stdout(io.StringIO()):
            make_prefix_trace.main([spec[0], str(path), *spec[1:]])
        trace = [json.loads(line) for line in path.read_text().splitlines()]
        for gb in args.budgets_gb:
            row = {f"ours {r}": ours(path, args.model_config, gb * 1e9, r, args.state_dtype) for r in RETENTIONS}
            if radix_cache is not None:
                start = time.perf_counter()
                row["Marconi V1 (LRU)"] = marconi(radix_cache, trace, gb * 1e9, 1, 0.0)
                row["Marconi V2"] = marconi(radix_cache, trace, gb * 1e9, 2, 0.0)
                oracle = {a: marconi(radix_cache, trace, gb * 1e9, 3, a) for a in ALPHAS}
                best = max(oracle, key=oracle.get)
                row["Marconi oracle"] = oracle[best]
                row["oracle alpha"] = best
                row["marconi seconds"] = time.perf_counter() - start
            results[f"{name}/{gb:g}GB"] = row
            cells = "  ".join(f"{k} {v:.3f}" for k, v in row.items() if not k.endswith(("alpha", "seconds")))
            print(f"{name:<14} {gb:>4g} GB  {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
