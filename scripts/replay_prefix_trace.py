"""Replays a request trace through the scheduler's prefix cache alone (no model) and reports
the token hit rate, the bytes each pool holds at the end and the evictions per pool.

    python scripts/replay_prefix_trace.py TRACE.jsonl --model-config path/to/config.json \
        --budget-bytes 4e9 [--ssm-fraction 0.4] [--state-dtype float32] [--kv-dtype float32] \
        [--page-size 16] [--retention dense|sparse|every=N] [--alpha 1.0] [--json OUT.json]
    python scripts/replay_prefix_trace.py TRACE.jsonl --model-config DIR \
        --kv-budget-bytes 3e9 --ssm-budget-bytes 1e9 [...]

The trace is JSON Lines in the format of `TRACES.md`; `input_tokens` and `output_tokens`
are required. Requests run one at a time in line order through the real `Scheduler`:
the prompt is prefilled (its `num_cached_tokens` is the hit), the trace's output tokens are
appended as if sampled, one decode step each, and the sequence is finished, so the caches
keep exactly what the engine's finished sequence leaves (its last output token is sampled,
never computed). Then the KV budget is applied: least recently used cached pages are
evicted down to it (SSM snapshots never exceed theirs). Token hit rate = hit tokens /
input tokens, over all requests.

Budget: `--budget-bytes` is split between the two pools, the SSM snapshot pool getting
`--ssm-fraction` of it (all of it goes to the one pool a plain transformer or a pure Mamba2
model has); `--kv-budget-bytes` / `--ssm-budget-bytes` set each pool instead. The running
request's own pages and its two live SSM slots are allocated outside the budget.
`--model-config` is a Hugging Face `config.json` or its directory; KV pages and conv
states are stored in `--kv-dtype`, SSM states in `--state-dtype`.
"""

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

from jaxengine.cache.page_cache import PageCache
from jaxengine.cache.state_cache import Retention, StateCache
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.llm_engine import prefix_flops
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import Scheduler
from jaxengine.engine.sequence import Sequence, Status
from jaxengine.models.config import MlpConfig, ModelConfig, load_model_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
DEFAULT_SSM_FRACTION = 0.4
LIVE_SSM_SLOTS = 2  # the running request's read and write slots
MAX_BATCHED_TOKENS = 1 << 30  # one chunk per prompt, cut only where the scheduler cuts it


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One line of a trace."""

    session_id: int
    turn_id: int
    input_tokens: list[int]
    output_tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Pools:
    """Sizes of the two pools: the budgeted cache part and the running request's part."""

    kv_page_bytes: int  # 0: the model has no attention layers
    checkpoint_bytes: int  # 0: the model has no Mamba layers
    kv_budget_bytes: int
    ssm_budget_bytes: int
    live_pages: int

    @property
    def budget_pages(self) -> int:
        return self.kv_budget_bytes // self.kv_page_bytes if self.kv_page_bytes else 0

    @property
    def budget_snapshots(self) -> int:
        return self.ssm_budget_bytes // self.checkpoint_bytes if self.checkpoint_bytes else 0


# ---------------------------------------------------------------------- inputs


def load_trace(path: Path) -> list[TraceRequest]:
    """The trace's requests in line order; a ValueError naming the line if one is malformed."""
    requests = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: a request must be a JSON object")
            requests.append(_parse_request(record, f"{path}:{number}"))
    if not requests:
        raise ValueError(f"{path}: the trace holds no requests")
    return requests


def _parse_request(record: dict, where: str) -> TraceRequest:
    for field in ("input_tokens", "output_tokens"):
        tokens = record.get(field)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{where}: '{field}' must be a list of token ids (a trace with token counts only "
                             f"cannot be replayed: hits depend on the tokens)")
        count = record.get(f"num_{field}")
        if count is not None and count != len(tokens):
            raise ValueError(f"{where}: num_{field}={count} but {field} holds {len(tokens)} tokens")
    if not record["input_tokens"]:
        raise ValueError(f"{where}: input_tokens is empty")
    return TraceRequest(record.get("session_id", -1), record.get("turn_id", -1), record["input_tokens"],
                        record["output_tokens"])


def read_model_config(path: Path) -> ModelConfig:
    """The model's config from a `config.json` path or the directory holding it."""
    return load_model_config(path.parent if path.name == "config.json" else path)


# ---------------------------------------------------------------------- sizes


def kv_page_bytes(cfg: ModelConfig, page_size: int, kv_bytes: int) -> int:
    """Bytes of one KV page over all attention layers (K and V); 0 without attention layers."""
    a = cfg.attention
    return 2 * page_size * a.num_kv_heads * a.head_dim * kv_bytes * cfg.num_attention_layers if a else 0


def checkpoint_bytes(cfg: ModelConfig, state_bytes: int, conv_bytes: int) -> int:
    """Bytes of one SSM checkpoint over all Mamba layers (SSM state + conv state); 0 without them."""
    m = cfg.mamba
    if m is None:
        return 0
    per_layer = m.num_heads * m.head_dim * m.state_size * state_bytes + m.conv_dim * m.conv_kernel * conv_bytes
    return cfg.num_mamba_layers * per_layer


def split_budget(cfg: ModelConfig, total: int, ssm_fraction: float) -> tuple[int, int, str]:
    """(KV bytes, SSM snapshot bytes, how) for a total budget."""
    if not cfg.num_mamba_layers:
        return total, 0, "all to KV pages (no Mamba layers)"
    if not cfg.num_attention_layers:
        return 0, total, "all to SSM snapshots (no attention layers)"
    ssm = int(total * ssm_fraction)
    return total - ssm, ssm, f"SSM snapshots get {ssm_fraction:g} of it (--ssm-fraction), KV pages the rest"


def num_weights(cfg: ModelConfig) -> int:
    """The model's weight count from its config (norms, biases and SSM scalars left out): what
    the engine's checkpoint eviction weighs saved compute with."""
    h = cfg.hidden_size
    total = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    for spec in cfg.layers:
        if spec.mixer == "attention":
            a = cfg.attention
            total += h * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim + a.num_heads * a.head_dim * h
        elif spec.mixer == "mamba":
            m = cfg.mamba
            in_proj = h * (m.intermediate_size + m.conv_dim + m.num_heads)  # z | xBC | dt
            total += in_proj + m.conv_dim * m.conv_kernel + m.intermediate_size * h
        if spec.ffn == "mlp":
            total += _mlp_weights(h, cfg.mlp)
        elif spec.ffn == "moe":
            moe = cfg.moe
            total += h * moe.num_experts + moe.num_experts * _mlp_weights(h, moe.expert) + _mlp_weights(h, moe.shared)
    return total


def _mlp_weights(hidden: int, mlp: MlpConfig) -> int:
    return (3 if mlp.gated else 2) * hidden * mlp.intermediate_size


# ---------------------------------------------------------------------- replay


def build_scheduler(cfg: ModelConfig, pools: Pools, page_size: int, retention: Retention, alpha: float) -> Scheduler:
    """A one-request-at-a-time scheduler over pools of the budgeted sizes plus the live part."""
    pages = states = None
    if pools.kv_page_bytes:
        pages = PageCache(1 + pools.budget_pages + pools.live_pages)
    if pools.checkpoint_bytes:
        weights = num_weights(cfg)
        states = StateCache(LIVE_SSM_SLOTS, pools.budget_snapshots, alpha=alpha,
                            flops_saved=lambda n: prefix_flops(cfg, weights, n))
    return Scheduler(max_num_seqs=1, max_num_batched_tokens=MAX_BATCHED_TOKENS, page_size=page_size, pages=pages,
                     states=states, retention=retention)


def replay_request(sched: Scheduler, request: TraceRequest, index: int) -> int:
    """Prefills, decodes and finishes one request as the engine would; returns its hit tokens."""
    prompt = list(request.input_tokens)
    seq = Sequence(str(index), index, prompt, len(prompt), SamplingParams(), seed=0)
    sched.add(seq)
    outputs = iter(request.output_tokens)
    while seq.status is not Status.FINISHED:
        step = sched.schedule()
        if not step.seqs:
            raise RuntimeError(f"request {index} could not be scheduled (pools too small for it)")
        sched.update(step)
        if seq.num_computed < len(seq.tokens):
            continue
        token = next(outputs, None)  # "sampled" once everything so far is computed
        if token is not None:
            seq.tokens.append(token)
        if token is None or seq.num_output_tokens == len(request.output_tokens):
            sched.finish(seq)
    return seq.num_cached_tokens


def trim_cached_pages(pages: PageCache, keep: int) -> None:
    """Evicts least recently used cached pages until at most `keep` remain. Between requests
    every cached page is unreferenced, so taking all free pages and then `excess` more evicts
    exactly `excess` of them, oldest first; giving them back leaves them free."""
    excess = pages.num_cached - keep
    if excess <= 0:
        return
    taken = pages.allocate(pages.num_free - pages.num_cached + excess)
    pages.release(taken)


def replay(requests: list[TraceRequest], sched: Scheduler, pools: Pools) -> list[int]:
    """Hit tokens of each request, in order."""
    hits = []
    for index, request in enumerate(requests):
        hits.append(replay_request(sched, request, index))
        if sched.pages is not None:
            trim_cached_pages(sched.pages, pools.budget_pages)
    return hits


# ---------------------------------------------------------------------- report


def summary(requests: list[TraceRequest], hits: list[int], sched: Scheduler, pools: Pools) -> dict:
    """Hit rate, what each pool holds at the end, evictions, and each request's hit."""
    num_input = sum(len(r.input_tokens) for r in requests)
    pages_held = sched.pages.num_cached if sched.pages is not None else 0
    snapshots_held = len(sched.states.snapshots) if sched.states is not None else 0
    return {
        "requests": len(requests),
        "input_tokens": num_input,
        "hit_tokens": sum(hits),
        "token_hit_rate": sum(hits) / num_input,
        "kv": {
            "page_bytes": pools.kv_page_bytes,
            "budget_bytes": pools.kv_budget_bytes,
            "budget_pages": pools.budget_pages,
            "live_pages": pools.live_pages if pools.kv_page_bytes else 0,
            "pages_held": pages_held,
            "bytes_held": pages_held * pools.kv_page_bytes,
            "evictions": sched.pages.evictions if sched.pages is not None else 0,
        },
        "ssm": {
            "checkpoint_bytes": pools.checkpoint_bytes,
            "budget_bytes": pools.ssm_budget_bytes,
            "budget_snapshots": pools.budget_snapshots,
            "live_slots": LIVE_SSM_SLOTS if pools.checkpoint_bytes else 0,
            "snapshots_held": snapshots_held,
            "bytes_held": snapshots_held * pools.checkpoint_bytes,
            "evictions": sched.states.evictions if sched.states is not None else 0,
        },
        "per_request": [
            {"session_id": r.session_id, "turn_id": r.turn_id, "input_tokens": len(r.input_tokens), "hit_tokens": h}
            for r, h in zip(requests, hits)
        ],
    }


def format_report(result: dict) -> str:
    """The human-readable lines printed after a replay."""
    kv, ssm, s = result["kv"], result["ssm"], result["settings"]
    return "\n".join([
        f"trace {s['trace']}: {result['requests']} requests, {result['input_tokens']} input tokens",
        f"model {s['architecture']}: {s['attention_layers']} attention + {s['mamba_layers']} Mamba layers; "
        f"page {s['page_size']} tokens = {kv['page_bytes']} B, one SSM checkpoint = {ssm['checkpoint_bytes']} B",
        f"budget {kv['budget_bytes'] + ssm['budget_bytes']:.4g} B: KV pages {kv['budget_bytes']:.4g} B "
        f"({kv['budget_pages']} pages), SSM snapshots {ssm['budget_bytes']:.4g} B ({ssm['budget_snapshots']} "
        f"checkpoints); {s['split']}",
        f"outside the budget: the running request's {kv['live_pages']} pages and {ssm['live_slots']} live SSM slots",
        f"retention {s['retention']} (scan checkpoint interval {s['checkpoint_interval']}), alpha {s['alpha']:g}",
        f"token hit rate: {result['token_hit_rate']:.4f} ({result['hit_tokens']} / {result['input_tokens']})",
        f"held at the end: KV pages {kv['bytes_held']} B ({kv['pages_held']} pages), "
        f"SSM snapshots {ssm['bytes_held']} B ({ssm['snapshots_held']} checkpoints)",
        f"evictions: KV pages {kv['evictions']}, SSM snapshots {ssm['evictions']}",
        f"replayed in {s['seconds']:.2f} s",
    ])


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, help="JSON Lines trace (TRACES.md format)")
    parser.add_argument("--model-config", type=Path, required=True, help="a Hugging Face config.json or its directory")
    parser.add_argument("--budget-bytes", type=float, help="total for both pools, split by --ssm-fraction")
    parser.add_argument("--ssm-fraction", type=float, default=DEFAULT_SSM_FRACTION,
                        help="share of --budget-bytes for SSM snapshots in a hybrid model")
    parser.add_argument("--kv-budget-bytes", type=float, help="KV page budget (instead of --budget-bytes)")
    parser.add_argument("--ssm-budget-bytes", type=float, help="SSM snapshot budget (instead of --budget-bytes)")
    parser.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), default="float32", help="KV pages and conv states")
    parser.add_argument("--state-dtype", choices=list(DTYPE_BYTES), default="float32", help="SSM states")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--retention", default="sparse", help="dense, sparse or every=N")
    parser.add_argument("--alpha", type=float, default=1.0, help="checkpoint eviction weight of saved compute; 0 is LRU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser


def _budgets(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: ModelConfig) -> tuple[int, int, str]:
    """(KV bytes, SSM bytes, how they were chosen), or a usage error."""
    explicit = args.kv_budget_bytes is not None or args.ssm_budget_bytes is not None
    if args.budget_bytes is not None:
        if explicit:
            parser.error("give --budget-bytes or --kv-budget-bytes/--ssm-budget-bytes, not both")
        if not 0 <= args.ssm_fraction <= 1:
            parser.error(f"--ssm-fraction must be in [0, 1], got {args.ssm_fraction}")
        return split_budget(cfg, int(args.budget_bytes), args.ssm_fraction)
    if cfg.num_attention_layers and args.kv_budget_bytes is None:
        parser.error("give --budget-bytes, or --kv-budget-bytes (the model has attention layers)")
    if cfg.num_mamba_layers and args.ssm_budget_bytes is None:
        parser.error("give --budget-bytes, or --ssm-budget-bytes (the model has Mamba layers)")
    return int(args.kv_budget_bytes or 0), int(args.ssm_budget_bytes or 0), "as given per pool"


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    cfg = read_model_config(args.model_config)
    kv_budget, ssm_budget, split = _budgets(parser, args, cfg)
    interval = EngineConfig(page_size=args.page_size).resolved_checkpoint_interval(cfg) if cfg.mamba else args.page_size
    try:
        retention = Retention.parse(args.retention, interval)
        requests = load_trace(args.trace)
    except ValueError as e:
        parser.error(str(e))
    kv_bytes = DTYPE_BYTES[args.kv_dtype]
    pools = Pools(
        kv_page_bytes=kv_page_bytes(cfg, args.page_size, kv_bytes),
        checkpoint_bytes=checkpoint_bytes(cfg, DTYPE_BYTES[args.state_dtype], kv_bytes),
        kv_budget_bytes=kv_budget,
        ssm_budget_bytes=ssm_budget,
        live_pages=max(math.ceil((len(r.input_tokens) + len(r.output_tokens)) / args.page_size) for r in requests),
    )
    sched = build_scheduler(cfg, pools, args.page_size, retention, args.alpha)
    start = time.perf_counter()
    hits = replay(requests, sched, pools)
    result = summary(requests, hits, sched, pools)
    result["settings"] = {
        "trace": str(args.trace), "model_config": str(args.model_config), "architecture": cfg.architecture,
        "attention_layers": cfg.num_attention_layers, "mamba_layers": cfg.num_mamba_layers,
        "page_size": args.page_size, "kv_dtype": args.kv_dtype, "state_dtype": args.state_dtype,
        "retention": args.retention, "checkpoint_interval": interval,
        "alpha": args.alpha, "split": split, "seconds": time.perf_counter() - start,
    }
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
