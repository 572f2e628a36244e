"""Prefix-cache token hit rate per memory budget: jaxengine's bookkeeping beside a clairvoyant
ceiling and Marconi's simulator, on real and synthetic traces.

    python scripts/bench_prefix_replay.py [--mooncake-dir PATH] [--marconi-dir PATH] \
        [--traces NAME ...] [--model-config configs/models/nemotron-h-7b-shape] \
        [--out-dir bench_replay] [--json OUT.json]

Traces (a request's token hit rate counts its prompt only; see `replay_prefix_trace.py`):
  mooncake-conv-K/M    Mooncake's FAST'25 conversation trace (an hour of production traffic),
                       the share replica K of M serves under prefix-affinity routing;
  mooncake-synth-K/M   its synthetic trace (public multi-turn data, Poisson arrivals), likewise;
                       both need `--mooncake-dir`, a directory holding `conversation_trace.jsonl`
                       and `synthetic_trace.jsonl` (kvcache-ai/Mooncake `FAST25-release/traces`);
  agentic              interleaved agent sessions over one 2,000-token tool specification
                       (`make_prefix_trace.py agentic --sessions 64 --max-active 32`);
  agentic-long-spec    the same with a 4,000-token specification and 64 sessions open at once;
  conversations        40 conversations x 6 turns, 512-token first messages, +64 answer +64
                       message per turn, ~33 other requests between two turns of one;
  few-shot             a 1,536-token instruction, 4 families x 4 tasks of 256 + 256 tokens;
  tokens:PATH          any trace in the token format of TRACES.md;
  mooncake:PATH[@K/M]  any trace in Mooncake's format, optionally one replica's share; its
                       blocks are `--block-tokens` tokens (Mooncake's: 512, the default;
                       Alibaba's Bailian traces: 16).
`--budgets` replaces every trace's budgets (GB); a file's default is 5 10 20 40 80 for
Mooncake's format and 1 2 4 8 for tokens.
Each runs at its budgets through `replay_prefix_trace.py` with retention `dense` (the default)
and `sparse`, KV and states in bfloat16 (as Marconi counts them), page 16, through
`clairvoyant_prefix_cache.py` (Belady's eviction: the ceiling; and least-recently-used
eviction of the same clairvoyant checkpoints: what knowing *which* content returns, but not
*when*, is worth), and with `--marconi-dir` (a checkout of ruipeterpan/marconi; it
needs scipy and transformers) through Marconi's simulator: V1 (SGLang's policy: LRU over radix
leaves) and V2 (Marconi: FLOP-efficiency and recency, alpha tuned online), with the model this
config describes. Marconi sizes a model from one width d and a state size n (`marconi_model`):
where its formulas count this model's KV and checkpoint bytes (within 5%, as for the default
7B shape) it gets the model's own dimensions; otherwise (grouped-query attention, states other
than Mamba2's) dimensions fitted so that it holds the bytes the replay holds.
Marconi counts hits at token granularity and a turn's last output token as cached; the engine
caches full pages of computed tokens and computes at least a prompt's last token. So each of
V1 and V2 is also given "in pages": its hits cut to whole pages short of the prompt's last
token (`page_hits`: an upper bound of what its cache would give under the engine's rules).
Its radix_cache_vllm variant is left out (its recursion fails on 12k-token requests).

Printed per trace and budget: token hit rate % of each, ours as a fraction of the ceiling, and
whether ours is at or above the better of V1 and V2; a flag when ours loses hits to more memory.
"""

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import clairvoyant_prefix_cache  # noqa: E402
import make_prefix_trace  # noqa: E402
import replay_prefix_trace  # noqa: E402

GB = 1e9
MOONCAKE_BUDGETS = [5, 10, 20, 40, 80]
SYNTHETIC = {  # name -> (make_prefix_trace arguments, budgets in GB)
    "agentic": (["agentic", "--sessions", "64", "--max-active", "32"], [1, 2, 4, 8]),
    "agentic-long-spec": (
        [
            "agentic",
            "--sessions",
            "128",
            "--max-active",
            "64",
            "--tool-spec-tokens",
            "4000",
            "--turns",
            "5",
            "15",
            "--seed",
            "3",
        ],
        [1, 2, 4, 8],
    ),
    "conversations": (
        [
            "conversations",
            "--conversations",
            "40",
            "--turns",
            "6",
            "--system-tokens",
            "0",
            "--first-message-tokens",
            "512",
            "512",
            "--message-tokens",
            "64",
            "64",
            "--output-tokens",
            "64",
            "64",
            "--max-active",
            "37",
        ],
        [1, 2, 4, 8],
    ),
    "few-shot": (["few-shot", "--instruction-tokens", "1536"], [0.25, 0.5, 1, 2]),
}
DEFAULT_TRACES = [
    "mooncake-conv-0/20",
    "mooncake-conv-1/20",
    "mooncake-conv-0/10",
    "mooncake-synth-0/10",
    "mooncake-synth-1/10",
    "mooncake-synth-0/5",
    *SYNTHETIC,
]
MOONCAKE_FILES = {"conv": "conversation_trace.jsonl", "synth": "synthetic_trace.jsonl"}


def load(
    name: str, mooncake_dir: Path | None, out_dir: Path, block_tokens: int = 512
) -> tuple[Path, list[str], list[float]]:
    """The trace file, the replay tool's format arguments, and the budgets (GB) of `name`
    (`block_tokens`: the block size of a `mooncake:PATH` trace)."""
    if name.startswith("tokens:"):
        return Path(name.removeprefix("tokens:")), [], [1, 2, 4, 8]
    if name.startswith("mooncake:"):
        path, _, replica = name.removeprefix("mooncake:").partition("@")
        fmt = ["--format", "mooncake", "--block-tokens", str(block_tokens)]
        return Path(path), fmt + (["--replica", replica] if replica else []), MOONCAKE_BUDGETS
    if name.startswith("mooncake-"):
        kind, replica = name.removeprefix("mooncake-").split("-", 1)
        if mooncake_dir is None:
            raise SystemExit(f"{name} needs --mooncake-dir")
        return mooncake_dir / MOONCAKE_FILES[kind], ["--format", "mooncake", "--replica", replica], MOONCAKE_BUDGETS
    spec, budgets = SYNTHETIC[name]
    path = out_dir / f"{name}.jsonl"
    with contextlib.redirect_stdout(io.StringIO()):
        make_prefix_trace.main([spec[0], str(path), *spec[1:]])
    return path, [], budgets


def marconi_kv_bytes(d: int) -> int:
    """Marconi's KV bytes per token of one attention layer (its `utils.get_kvs_size`): K and V
    of width d, 2 bytes each."""
    return 2 * d * 2


def marconi_state_bytes(d: int, n: int) -> int:
    """Marconi's bytes of one SSM layer's state (its `utils.get_mamba_state_size`, expand 2,
    conv kernel 4): a d x n state and a conv window of 2d + 2n channels, 2 bytes each."""
    return d * n * 2 + (2 * d + 2 * n) * 4 * 2


def marconi_model(cfg, s: replay_prefix_trace.Sizes, page_size: int) -> dict:
    """Marconi's model arguments for `cfg`. Its one width d stands for both the KV width of an
    attention layer and the model width of an SSM layer (true of the 7B shape it was written
    for). Where that counts the replay's KV bytes a token and checkpoint bytes within 5%, the
    model's own dimensions; otherwise d is the attention layers' KV width (the model width
    without attention) and n the state size at which the model's SSM layers hold the replay's
    checkpoint, so both caches hold the same bytes (V2's FLOP estimates then use those too)."""
    layers = dict(
        num_ssm_layers=cfg.num_recurrent_layers,
        num_attn_layers=cfg.num_attention_layers,
        num_mlp_layers=sum(layer.ffn is not None for layer in cfg.layers),
    )
    kv = s.kv_page_bytes / page_size  # the replay's KV bytes a token, every attention layer
    a = cfg.attention
    if cfg.mamba is not None:
        own = dict(d=cfg.hidden_size, n=cfg.mamba.state_size)
        kv_own = cfg.num_attention_layers * marconi_kv_bytes(own["d"])
        state_own = cfg.num_recurrent_layers * marconi_state_bytes(own["d"], own["n"])
        if abs(kv_own - kv) <= 0.05 * kv and abs(state_own - s.checkpoint_bytes) <= 0.05 * s.checkpoint_bytes:
            return dict(layers, **own)
    d = round(kv / (cfg.num_attention_layers * marconi_kv_bytes(1))) if a else cfg.hidden_size
    n = 0
    if cfg.num_recurrent_layers:
        per_layer = s.checkpoint_bytes / cfg.num_recurrent_layers  # = 2dn + 16d + 16n
        n = max(1, round((per_layer - 16 * d) / (2 * d + 16)))
    return dict(layers, d=d, n=n)


def marconi(
    radix_cache, requests: list, budget: float, version: int, model: dict, page_size: int
) -> tuple[float, float]:
    """Token hit rates of Marconi's simulator (its own replay loop) on `requests`, with the
    model arguments `model` (`marconi_model`): as it counts them, and each request's hit cut
    to whole pages short of its prompt's last token (`page_hits`)."""
    tree = radix_cache(
        capacity_bytes=budget, evict_policy_version=version, eff_weight=0.0, use_logical_ts=True, **model
    )
    with contextlib.redirect_stdout(io.StringIO()):
        for i, r in enumerate(requests):
            prompt = list(r.input_tokens)
            tree.match_prefix(prompt)
            tree.insert(token_ids=prompt + list(r.output_tokens), state_at_leaf=i, state_at_branchoff=i)
    _, prompts, saved = zip(*tree.request_history)  # (hit, prompt tokens, tokens saved) per request
    return sum(saved) / sum(prompts), sum(page_hits(saved, prompts, page_size)) / sum(prompts)


def page_hits(saved: list[int], prompts: list[int], page_size: int) -> list[int]:
    """Token hits (`saved`, of prompts `prompts` tokens long) counted as the engine counts its
    own: whole pages, and at least the prompt's last token computed. Marconi's cache holds a
    state at each hit's exact end, not at the page boundary below it, so this bounds from above
    what its content would give under the engine's rules."""
    return [min(hit // page_size, (n - 1) // page_size) * page_size for hit, n in zip(saved, prompts)]


def replay_arguments(path: Path, fmt: list[str], model_config: Path) -> list[str]:
    """`replay_prefix_trace.py`'s arguments for a trace as the tables count it (KV and states
    in bfloat16, as Marconi counts them), all but the budget."""
    return [str(path), *fmt, "--model-config", str(model_config), "--kv-dtype", "bfloat16", "--state-dtype", "bfloat16"]


def run_trace(name: str, path: Path, fmt: list[str], budgets: list[float], model_config: Path, radix_cache) -> dict:
    parser = argparse.ArgumentParser()
    replay_prefix_trace.add_trace_arguments(parser)
    common = replay_arguments(path, fmt, model_config)
    requests, cfg, _ = replay_prefix_trace.trace_and_sizes(parser, parser.parse_args([*common, "--budget-bytes", "0"]))
    num_input = sum(len(r.input_tokens) for r in requests)
    longest = max(len(r.input_tokens) + len(r.output_tokens) for r in requests)
    rows = {}
    for gb in budgets:
        s = replay_prefix_trace.sizes(cfg, int(gb * GB), 16, 2, 2, longest)
        row = {}
        for retention, interval in (("dense", None), ("sparse", 0)):
            sched = replay_prefix_trace.build_scheduler(cfg, s, 16, interval)
            row[f"ours {retention}"] = sum(replay_prefix_trace.replay(requests, sched, s)) / num_input
            if retention == "dense":
                row["lost to want of a checkpoint"] = sched.stats.tokens_lost / num_input
        for eviction, column in (("belady", "clairvoyant"), ("lru", "clairvoyant which, LRU")):
            hits = clairvoyant_prefix_cache.best_hits(
                requests,
                eviction,
                page_size=16,
                checkpoint_blocks=s.checkpoint_blocks,
                page_blocks=1 if s.kv_page_bytes else 0,
                budget_blocks=s.budget_blocks,
            )
            row[column] = sum(hits) / num_input
        if radix_cache is not None:
            start = time.perf_counter()
            model = marconi_model(cfg, s, 16)
            for version in (1, 2):
                as_counted, in_pages = marconi(radix_cache, requests, gb * GB, version, model, 16)
                row[f"Marconi V{version}"] = as_counted
                row[f"Marconi V{version} in pages"] = in_pages
            row["marconi seconds"] = time.perf_counter() - start
        rows[f"{gb:g}"] = row
        print(_line(name, gb, row), flush=True)
    hits = [rows[f"{gb:g}"]["ours dense"] for gb in budgets]
    monotone = all(b >= a - 0.01 for a, b in zip(hits, hits[1:]))
    if not monotone:
        print(f"{name}: ours loses hits to more memory: {[round(100 * h, 1) for h in hits]}", flush=True)
    return {
        "budgets_gb": budgets,
        "requests": len(requests),
        "input_tokens": num_input,
        "rows": rows,
        "monotone": monotone,
    }


def _line(name: str, gb: float, row: dict) -> str:
    cells = "  ".join(f"{k} {100 * v:5.1f}" for k, v in row.items() if not k.endswith("seconds"))
    ratio = row["ours dense"] / row["clairvoyant"] if row["clairvoyant"] else 1.0
    verdict = ""
    if "Marconi V1" in row:
        best = max(row["Marconi V1"], row["Marconi V2"])
        in_pages = max(row["Marconi V1 in pages"], row["Marconi V2 in pages"])
        if row["ours dense"] >= best:
            verdict = "  >= best Marconi"
        elif row["ours dense"] >= in_pages:
            verdict = f"  >= best Marconi in pages, below as it counts ({100 * best:.1f})"
        else:
            verdict = f"  BELOW best Marconi ({100 * best:.1f}; in pages {100 * in_pages:.1f})"
    return f"{name:<22} {gb:>5g} GB  {cells}  ours/ceiling {ratio:.2f}{verdict}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mooncake-dir", type=Path, help="holds Mooncake's conversation and synthetic traces")
    parser.add_argument("--marconi-dir", type=Path, help="a checkout of ruipeterpan/marconi")
    parser.add_argument(
        "--traces", nargs="+", help=f"default: {' '.join(DEFAULT_TRACES)} (mooncake ones only with --mooncake-dir)"
    )
    parser.add_argument("--budgets", type=float, nargs="+", help="GB, for every trace (default: per trace)")
    parser.add_argument(
        "--model-config", type=Path, default=Path(__file__).parent.parent / "configs" / "models" / "nemotron-h-7b-shape"
    )
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per block of the mooncake:PATH traces")
    parser.add_argument("--out-dir", type=Path, default=Path("bench_replay"))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    names = args.traces or [t for t in DEFAULT_TRACES if args.mooncake_dir or not t.startswith("mooncake-")]
    radix_cache = None
    if args.marconi_dir:
        sys.path.insert(0, str(args.marconi_dir))
        from radix_cache_hybrid import RadixCache as radix_cache  # noqa: N813
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {"date": time.strftime("%Y-%m-%d"), "model_config": str(args.model_config), "traces": {}}
    for name in names:
        path, fmt, budgets = load(name, args.mooncake_dir, args.out_dir, args.block_tokens)
        budgets = args.budgets or budgets
        results["traces"][name] = run_trace(name, path, fmt, budgets, args.model_config, radix_cache)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
