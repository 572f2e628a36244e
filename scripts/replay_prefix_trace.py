"""Replays a request trace through the engine's prefix-cache bookkeeping alone (no model) and
reports the token hit rate, the bytes pages and checkpoints hold at the end, and evictions.

    python scripts/replay_prefix_trace.py TRACE.jsonl --model-config path/to/config.json \
        --budget-bytes 4e9 [--state-dtype float32] [--kv-dtype float32] [--page-size 16] \
        [--retention dense|sparse|every=N] [--json OUT.json]
    python scripts/replay_prefix_trace.py conversation_trace.jsonl --format mooncake \
        [--block-tokens 512] [--replica K/M] --model-config ... --budget-bytes ...

The trace is JSON Lines in the format of `TRACES.md` (`--format tokens`, the default;
`input_tokens` and `output_tokens` are required), or Mooncake's (`--format mooncake`: the
FAST'25 traces of kvcache-ai/Mooncake, and traces in the same fields such as Alibaba's Bailian
traces with `--block-tokens 16`): `input_length`, `output_length` and `hash_ids`, one id per
block of `--block-tokens` prompt tokens, equal ids meaning equal blocks. Each block id becomes
`--block-tokens` token ids of its own, the last block cut to the input length; each output
gets fresh ids, so a hit can end only at a block boundary (prompts are held as their blocks'
ids and expanded one request at a time, so traces of hundreds of millions of tokens, such as
those hashed per 16-token block, fit in memory). Mooncake's requests run in order of arrival
(`timestamp`, or a session's `delay` after its turn before: `arrival_order`), a token trace's
in line order. `--replica K/M` keeps the requests one of M replicas serves under
prefix-affinity routing: those whose second block id (the first, for a one-block prompt; the
first block is a prompt every request shares) is K mod M. Requests run one at a time through
the real `Scheduler` and
`PrefixCache`: the prompt is prefilled in one chunk (its `num_cached_tokens` is the hit), the
trace's output tokens are appended as if sampled, one decode step each, and the sequence is
finished, so the cache keeps exactly what the engine's finished sequence leaves (its last
output token is computed only when it completes a page). Then the budget is applied: cache content is
evicted, in the cache's own order, until it fits. Token hit rate = hit tokens / input tokens.

Budget: `--budget-bytes` holds all cached content, KV pages and recurrent-state checkpoints
together, in blocks of one KV page (a checkpoint takes as many blocks as its bytes need; for
a model without attention layers a block is one checkpoint). How it divides between the two
follows the trace. The running request's own pages and its two live state slots come on top,
as running sequences' do in the engine. `--pool-blocks N` instead replays the engine's own
arrangement: one pool of N blocks (the null block included) that the running request's pages
come out of too, and nothing evicted until a block is needed. `--model-config` is a Hugging Face `config.json` or
its directory; KV pages and conv states are stored in `--kv-dtype`, recurrent states (SSM,
delta rule) in `--state-dtype`. `--retention` is the engine's `prefix_cache_retention_interval`: `dense`
(None, the default for models with recurrent layers), `sparse` (0) or `every=N` (N).
"""

import argparse
import collections.abc
import dataclasses
import functools
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxengine.cache import checkpoint_policy
from jaxengine.cache.block_pool import BlockPool
from jaxengine.cache.hit_value import ModelCosts
from jaxengine.cache.live_slots import LiveSlots
from jaxengine.cache.prefix_cache import PrefixCache
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import Scheduler
from jaxengine.engine.sequence import Sequence, Status
from jaxengine.models.arch import load_model_config
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import abstract_model
from jaxengine.models.mixers import recurrent_states

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LIVE_SLOTS = 2  # the running request's read and write slots
MAX_BATCHED_TOKENS = 1 << 30  # one chunk per prompt


class BlockTokens(collections.abc.Sequence):
    """Token ids in runs of consecutive ids, made when read: run k is `starts[k]`,
    `starts[k] + 1`, ... (`run_tokens` of them), all runs together cut to `length` tokens.
    Mooncake's prompts are such runs (block h starts at h * block tokens) and so are its fresh
    outputs (one run). Only the starts are held, so a trace of hundreds of millions of tokens
    fits in memory; a request's list of ids is made while it is replayed (`tolist`)."""

    def __init__(self, starts: list[int], run_tokens: int, length: int):
        self.starts = np.asarray(starts, np.int64)  # [runs]
        self.run_tokens = run_tokens
        self.length = length

    def tolist(self) -> list[int]:
        runs = self.starts[:, None] + np.arange(self.run_tokens)  # [runs, run_tokens]
        return runs.reshape(-1)[: self.length].tolist()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.tolist()[index]
        if not -self.length <= index < self.length:
            raise IndexError("token index out of range")
        run, offset = divmod(index % self.length, self.run_tokens)
        return int(self.starts[run]) + offset

    def __iter__(self):
        return iter(self.tolist())

    def __add__(self, other) -> list[int]:
        return self.tolist() + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + self.tolist()

    def __eq__(self, other) -> bool:
        if not isinstance(other, list | BlockTokens):
            return NotImplemented
        return self.tolist() == list(other)

    def __repr__(self) -> str:
        return f"BlockTokens(starts={self.starts.tolist()}, run_tokens={self.run_tokens}, length={self.length})"

    __hash__ = None


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One line of a trace."""

    session_id: int
    turn_id: int
    input_tokens: list[int] | BlockTokens
    output_tokens: list[int] | BlockTokens


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Block size and how many blocks the budget and the running request get."""

    kv_page_bytes: int  # 0: the model has no attention layers
    checkpoint_bytes: int  # 0: the model has no recurrent layers
    block_bytes: int
    checkpoint_blocks: int
    budget_blocks: int
    live_blocks: int


# ---------------------------------------------------------------------- inputs


def json_lines(path: Path) -> Iterator[tuple[str, dict]]:
    """Each non-empty line of `path` as (`path:line`, its JSON object); a ValueError naming the
    line if one is not a JSON object."""
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON line ({e})") from e
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a request must be a JSON object")
            yield where, record


def load_trace(path: Path) -> list[TraceRequest]:
    """The trace's requests in line order; a ValueError naming the line if one is malformed."""
    requests = [_parse_request(record, where) for where, record in json_lines(path)]
    if not requests:
        raise ValueError(f"{path}: the trace holds no requests")
    return requests


def load_mooncake(path: Path, block_tokens: int, replica: tuple[int, int] | None = None) -> list[TraceRequest]:
    """A Mooncake trace's requests in order of arrival (`arrival_order`), expanded to token ids
    (see the module's docstring); a ValueError naming the line if one is malformed."""
    records = arrival_order([_check_mooncake(record, where, block_tokens) for where, record in json_lines(path)])
    if replica is not None:
        k, m = replica
        records = [r for r in records if r["hash_ids"][min(1, len(r["hash_ids"]) - 1)] % m == k]
    if not records:
        raise ValueError(f"{path}: no requests" + (f" in replica {replica[0]}/{replica[1]}" if replica else ""))
    # Each block id gets a run of token ids of its own, ids numbered in order of first use (a
    # trace's ids may be 64-bit hashes, as the SipHash ids of Alibaba's Bailian traces are);
    # outputs take fresh ids past every block's.
    runs: dict[int, int] = {}
    starts = [[runs.setdefault(h, len(runs)) * block_tokens for h in r["hash_ids"]] for r in records]
    fresh = len(runs) * block_tokens
    requests = []
    for index, (r, prompt_starts) in enumerate(zip(records, starts)):
        prompt = BlockTokens(prompt_starts, block_tokens, r["input_length"])
        output = BlockTokens([fresh], r["output_length"], r["output_length"])
        fresh += r["output_length"]
        requests.append(TraceRequest(-1, index, prompt, output))
    return requests


def arrival_order(records: list[dict]) -> list[dict]:
    """The records in the order their requests arrive: by `timestamp` (ties in line order),
    where a record without one is a later turn of a session given as a `delay` after the turn
    before it (`session_id`; the multi-turn form of Mooncake's format that aiperf reads; the
    time that turn took to serve is not known, so it counts as none); in line order where
    neither says when a request arrives."""
    arrivals, last_of_session = [], {}
    for r in records:
        if "timestamp" in r:
            at = r["timestamp"]
        elif "delay" in r and r.get("session_id") in last_of_session:
            at = last_of_session[r["session_id"]] + r["delay"]
        else:
            return records
        last_of_session[r.get("session_id")] = at
        arrivals.append(at)
    return [records[i] for i in sorted(range(len(records)), key=arrivals.__getitem__)]


def _check_mooncake(record: dict, where: str, block_tokens: int) -> dict:
    for field in ("input_length", "output_length"):
        if not isinstance(record.get(field), int) or record[field] < (field == "input_length"):
            raise ValueError(
                f"{where}: '{field}' must be a {'positive' if field == 'input_length' else 'non-negative'} "
                f"integer, got {record.get(field)!r}"
            )
    for field in ("timestamp", "delay"):
        if field in record and (not isinstance(record[field], int | float) or isinstance(record[field], bool)):
            raise ValueError(f"{where}: '{field}' must be a number, got {record[field]!r}")
    ids = record.get("hash_ids")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise ValueError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    if len(ids) != math.ceil(record["input_length"] / block_tokens):
        raise ValueError(
            f"{where}: {len(ids)} hash_ids for input_length={record['input_length']}, but blocks of "
            f"{block_tokens} tokens need {math.ceil(record['input_length'] / block_tokens)} "
            f"(is --block-tokens right?)"
        )
    return record


def parse_replica(text: str) -> tuple[int, int]:
    """`K/M` as (K, M), 0 <= K < M."""
    try:
        k, m = (int(x) for x in text.split("/"))
    except ValueError:
        k, m = -1, 0
    if not 0 <= k < m:
        raise ValueError(f"--replica must be K/M with 0 <= K < M, got {text!r}")
    return k, m


def _parse_request(record: dict, where: str) -> TraceRequest:
    for field in ("input_tokens", "output_tokens"):
        tokens = record.get(field)
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(
                f"{where}: '{field}' must be a list of token ids (a trace with token counts only "
                f"cannot be replayed: hits depend on the tokens)"
            )
        count = record.get(f"num_{field}")
        if count is not None and count != len(tokens):
            raise ValueError(f"{where}: num_{field}={count} but {field} holds {len(tokens)} tokens")
    if not record["input_tokens"]:
        raise ValueError(f"{where}: input_tokens is empty")
    return TraceRequest(
        record.get("session_id", -1), record.get("turn_id", -1), record["input_tokens"], record["output_tokens"]
    )


def read_model_config(path: Path) -> ModelConfig:
    """The model's config from a `config.json` path or the directory holding it."""
    return load_model_config(path.parent if path.name == "config.json" else path)


def parse_retention(text: str, page_size: int) -> int | None:
    """`dense` / `sparse` / `every=N` as the engine's retention interval."""
    if text == "dense":
        return checkpoint_policy.DENSE
    if text == "sparse":
        return checkpoint_policy.SPARSE
    if text.startswith("every="):
        try:
            interval = int(text.split("=", 1)[1])
        except ValueError:
            interval = -1
        if interval > 0:
            checkpoint_policy.validate_interval(interval, page_size)
            return interval
    raise ValueError(
        f"--retention must be dense, sparse or every=N (N a positive multiple of the page size), got {text!r}"
    )


# ---------------------------------------------------------------------- sizes


def kv_page_bytes(cfg: ModelConfig, page_size: int, kv_bytes: int) -> int:
    """Bytes of one KV page over all attention layers (K and V); 0 without attention layers."""
    a = cfg.attention
    return 2 * page_size * a.num_kv_heads * a.head_dim * kv_bytes * cfg.num_attention_layers if a else 0


def checkpoint_bytes(cfg: ModelConfig, state_bytes: int, conv_bytes: int) -> int:
    """Bytes of one recurrent-state checkpoint over all recurrent layers, from the state
    arrays their mixers declare: float32 ones (the recurrent states) at `state_bytes` per
    element, the others (conv windows) at `conv_bytes`; 0 without recurrent layers."""
    return sum(a.size * (state_bytes if a.float32 else conv_bytes) for arrays in recurrent_states(cfg) for a in arrays)


@functools.cache
def num_weights(cfg: ModelConfig) -> int:
    """The model's parameter count, from its structure (no values are made)."""
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(abstract_model(cfg, jnp.float32))))


def sizes(
    cfg: ModelConfig, budget_bytes: int, page_size: int, kv_bytes: int, state_bytes: int, longest_request: int
) -> Sizes:
    page = kv_page_bytes(cfg, page_size, kv_bytes)
    ckpt = checkpoint_bytes(cfg, state_bytes, kv_bytes)
    block = page or ckpt
    return Sizes(
        kv_page_bytes=page,
        checkpoint_bytes=ckpt,
        block_bytes=block,
        checkpoint_blocks=math.ceil(ckpt / block) if ckpt else 0,
        budget_blocks=budget_bytes // block,
        live_blocks=math.ceil(longest_request / page_size) if page else 0,
    )


# ---------------------------------------------------------------------- replay


def build_scheduler(cfg: ModelConfig, s: Sizes, page_size: int, retention: int | None) -> Scheduler:
    """A one-request-at-a-time scheduler over a pool of the budget plus the running request's part."""
    a = cfg.attention
    costs = ModelCosts(
        num_weights=num_weights(cfg),
        attention_width=cfg.num_attention_layers * a.num_heads * a.head_dim if a else 0,
        kv_bytes_per_token=s.kv_page_bytes // page_size,
        checkpoint_bytes=s.checkpoint_blocks * s.block_bytes,
    )
    pool = BlockPool(1 + s.budget_blocks + s.live_blocks)
    cache = PrefixCache(
        pool,
        page_size=page_size,
        has_kv=bool(s.kv_page_bytes),
        checkpoint_blocks=s.checkpoint_blocks,
        value=costs.value_fn(),
        checkpoint_value=costs.checkpoint_value,
    )
    slots = LiveSlots(LIVE_SLOTS) if s.checkpoint_bytes else None
    return Scheduler(
        max_num_seqs=1,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        page_size=page_size,
        cache=cache,
        slots=slots,
        retention_interval=retention,
    )


def replay_request(sched: Scheduler, request: TraceRequest, index: int) -> int:
    """Prefills, decodes and finishes one request as the engine would; returns its hit tokens."""
    prompt = list(request.input_tokens)
    seq = Sequence(str(index), index, prompt, len(prompt), SamplingParams(), seed=0)
    sched.add(seq)
    outputs = iter(request.output_tokens)
    while seq.status is not Status.FINISHED:
        step = sched.schedule()
        if not step.seqs:
            raise RuntimeError(f"request {index} could not be scheduled (pool too small for it)")
        sched.update(step)
        if seq.status is not Status.RUNNING or seq.num_computed < len(seq.tokens):
            continue  # finished, completing its last page, or a prefill that goes on
        token = next(outputs, None)  # "sampled" once everything so far is computed
        if token is not None:
            seq.tokens.append(token)
        if token is None or seq.num_output_tokens == len(request.output_tokens):
            sched.finish(seq)
    return seq.num_cached_tokens


def replay(requests: list[TraceRequest], sched: Scheduler, s: Sizes) -> list[int]:
    """Hit tokens of each request, in order."""
    hits = []
    for index, request in enumerate(requests):
        hits.append(replay_request(sched, request, index))
        sched.cache.trim(s.budget_blocks)
    return hits


# ---------------------------------------------------------------------- report


def summary(requests: list[TraceRequest], hits: list[int], sched: Scheduler, s: Sizes) -> dict:
    """Hit rate, what pages and checkpoints hold at the end, evictions, and each request's hit."""
    cache = sched.cache
    num_input = sum(len(r.input_tokens) for r in requests)
    pages_held = cache.num_page_blocks if s.kv_page_bytes else 0
    c = cache.counters
    return {
        "requests": len(requests),
        "input_tokens": num_input,
        "hit_tokens": sum(hits),
        "token_hit_rate": sum(hits) / num_input,
        "lost_tokens": sched.stats.tokens_lost,
        "budget": {
            "budget_bytes": s.budget_blocks * s.block_bytes,
            "block_bytes": s.block_bytes,
            "budget_blocks": s.budget_blocks,
            "live_blocks": s.live_blocks,
            "live_slots": LIVE_SLOTS if s.checkpoint_bytes else 0,
        },
        "kv": {
            "page_bytes": s.kv_page_bytes,
            "pages_held": pages_held,
            "bytes_held": pages_held * s.block_bytes,
            "evictions": c.pages_evicted,
        },
        "ssm": {
            "checkpoint_bytes": s.checkpoint_bytes,
            "checkpoint_blocks": s.checkpoint_blocks,
            "checkpoints_held": len(cache.checkpoints),
            "bytes_held": cache.num_checkpoint_blocks * s.block_bytes,
            "written": c.checkpoints_written,
            "skipped": c.checkpoints_skipped,
            "evictions": c.checkpoints_evicted,
        },
        "per_request": [
            {"session_id": r.session_id, "turn_id": r.turn_id, "input_tokens": len(r.input_tokens), "hit_tokens": h}
            for r, h in zip(requests, hits)
        ],
    }


def format_report(result: dict) -> str:
    """The human-readable lines printed after a replay."""
    b, kv, ssm, s = result["budget"], result["kv"], result["ssm"], result["settings"]
    return "\n".join(
        [
            f"trace {s['trace']}: {result['requests']} requests, {result['input_tokens']} input tokens",
            f"model {s['architecture']}: {s['attention_layers']} attention + {s['recurrent_layers']} recurrent layers; "
            f"page {s['page_size']} tokens = {kv['page_bytes']} B, one checkpoint = {ssm['checkpoint_bytes']} B "
            f"({ssm['checkpoint_blocks']} blocks of {b['block_bytes']} B)",
            f"budget {b['budget_bytes']:.4g} B ({b['budget_blocks']} blocks) for KV pages and checkpoints together; "
            f"outside it: the running request's {b['live_blocks']} blocks and {b['live_slots']} live state slots",
            f"retention {s['retention']}",
            f"token hit rate: {result['token_hit_rate']:.4f} ({result['hit_tokens']} / {result['input_tokens']}); "
            f"lost for want of a checkpoint: {result['lost_tokens']} tokens",
            f"held at the end: KV pages {kv['bytes_held']} B ({kv['pages_held']} pages), "
            f"checkpoints {ssm['bytes_held']} B ({ssm['checkpoints_held']})",
            f"evictions: KV pages {kv['evictions']}, checkpoints {ssm['evictions']}; checkpoints written "
            f"{ssm['written']}, skipped for want of room {ssm['skipped']}",
            f"replayed in {s['seconds']:.2f} s",
        ]
    )


# ---------------------------------------------------------------------- command line


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The trace, model and budget arguments (shared with `clairvoyant_prefix_cache.py`)."""
    parser.add_argument("trace", type=Path, help="JSON Lines trace")
    parser.add_argument(
        "--format",
        choices=["tokens", "mooncake"],
        default="tokens",
        help="tokens: TRACES.md's format; mooncake: Mooncake's block hashes",
    )
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per hash id (mooncake)")
    parser.add_argument("--replica", help="K/M: the requests replica K of M serves (mooncake)")
    parser.add_argument("--model-config", type=Path, required=True, help="a Hugging Face config.json or its directory")
    parser.add_argument("--budget-bytes", type=float, required=True, help="for KV pages and checkpoints together")
    parser.add_argument("--kv-dtype", choices=list(DTYPE_BYTES), default="float32", help="KV pages and conv states")
    parser.add_argument("--state-dtype", choices=list(DTYPE_BYTES), default="float32", help="SSM states")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the results here")


def trace_and_sizes(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[TraceRequest], ModelConfig, Sizes]:
    """The trace's requests, the model's config and the block sizes, from the arguments of
    `add_trace_arguments`; a usage error naming the argument when one is wrong."""
    if args.budget_bytes < 0 or args.page_size < 1 or args.block_tokens < 1:
        parser.error("--budget-bytes must be >= 0, --page-size and --block-tokens >= 1")
    if args.format == "tokens" and args.replica:
        parser.error("--replica applies to --format mooncake only")
    cfg = read_model_config(args.model_config)
    try:
        if args.format == "mooncake":
            replica = parse_replica(args.replica) if args.replica else None
            requests = load_mooncake(args.trace, args.block_tokens, replica)
        else:
            requests = load_trace(args.trace)
    except ValueError as e:
        parser.error(str(e))
    longest = max(len(r.input_tokens) + len(r.output_tokens) for r in requests)
    s = sizes(
        cfg, int(args.budget_bytes), args.page_size, DTYPE_BYTES[args.kv_dtype], DTYPE_BYTES[args.state_dtype], longest
    )
    return requests, cfg, s


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_trace_arguments(parser)
    parser.add_argument("--retention", default="dense", help="dense, sparse or every=N")
    parser.add_argument("--pool-blocks", type=int, help="the engine's pool instead of a budget (see above)")
    args = parser.parse_args(argv)
    try:
        retention = parse_retention(args.retention, args.page_size)
    except ValueError as e:
        parser.error(str(e))
    requests, cfg, s = trace_and_sizes(parser, args)
    if args.pool_blocks is not None:
        if args.pool_blocks < 2:
            parser.error(f"--pool-blocks must be >= 2, got {args.pool_blocks}")
        s = dataclasses.replace(s, budget_blocks=args.pool_blocks - 1, live_blocks=0)
    sched = build_scheduler(cfg, s, args.page_size, retention)
    start = time.perf_counter()
    hits = replay(requests, sched, s)
    result = summary(requests, hits, sched, s)
    result["settings"] = {
        "trace": str(args.trace),
        "format": args.format,
        "block_tokens": args.block_tokens,
        "replica": args.replica,
        "model_config": str(args.model_config),
        "architecture": cfg.architecture,
        "attention_layers": cfg.num_attention_layers,
        "recurrent_layers": cfg.num_recurrent_layers,
        "page_size": args.page_size,
        "kv_dtype": args.kv_dtype,
        "state_dtype": args.state_dtype,
        "retention": args.retention,
        "retention_interval": retention,
        "seconds": time.perf_counter() - start,
    }
    print(format_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
