"""One-command device check of the GPU kernels and the engine on one CUDA GPU.

Usage (from the repository root):
  python scripts/device_check.py [--quick] [--parts kernels,engine,verify,startup] [--json device_check.json] [--budget-s 420]

Parts: a roofline probe (HBM bandwidth, bf16 matmul rate) that sets each row's floor; the
GPU Pallas kernels against their pure-jnp references on real shapes (error and time); the
engine on a random 1B-parameter Bamba with kernels="auto" and "reference" (decode and
prefill tokens/s, load and compile times, first greedy tokens compared); verify steps with
ngram and a draft model; and the default model's start-up, with the step shapes that buy
nothing there (`bench_shapes.py`). What each row measures, its
floor and its tolerance: `docs/device-check.md`.

A global deadline (--budget-s, from the start of main) skips the checks that would not fit
in it, each with a "skipped (time)" row. --quick runs tiny shapes and a tiny model; without a
GPU the kernels run in interpret mode (the engine with kernels="pallas-interpret-gpu"), which
exercises this script's logic on CPU. The report goes to the JSON file (device, jax version,
date, every row with its details) and a short table is printed last. Exit status 1 if a check
failed or errored.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.gated_delta import kernel_gpu as gated_delta_gpu
from pallas_kernels.gated_delta.reference import ragged_gated_delta
from pallas_kernels.ragged_paged_attention import kernel_gpu as attention_gpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from pallas_kernels.selective_scan import kernel_gpu as selective_gpu
from pallas_kernels.selective_scan.reference import ragged_selective_scan
from pallas_kernels.ssd import kernel_gpu as ssd_gpu
from pallas_kernels.ssd.reference import RaggedScanOutput, ragged_ssd_scan

PARTS = ("kernels", "engine", "verify", "startup")
SKIPPED = "skipped (time)"
ATTENTION_TOL = 2.0**-6  # x max|v|, and v is uniform in [-1, 1]
Q_SCALE = 3.0  # query scale: score std 3, so a few keys dominate each softmax
SSD_RTOL = 5e-4  # x each output's largest magnitude
FIRST_TOKEN_TOL = 0.25  # fraction of requests whose first greedy token may differ
SEED = 0

if TYPE_CHECKING:
    import torch

    from jaxengine.engine.outputs import RequestOutput


# ---------------------------------------------------------------------------- plan


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    name: str
    q_lens: tuple[int, ...]  # query tokens per sequence
    kv_lens: tuple[int, ...]  # context per sequence, this step's tokens included
    num_pad: int  # padding tokens after the last sequence
    q_heads: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    dtype: str = "bfloat16"


@dataclasses.dataclass(frozen=True)
class SsdCase:
    name: str
    lengths: tuple[int, ...]  # tokens per sequence
    start_pos: tuple[int, ...]  # absolute position of each sequence's first token
    num_pad: int
    num_heads: int
    num_groups: int
    head_dim: int
    state_size: int
    chunk_size: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class SelectiveCase:
    name: str
    lengths: tuple[int, ...]  # tokens per sequence
    start_pos: tuple[int, ...]  # absolute position of each sequence's first token
    num_pad: int
    channels: int
    state_size: int
    chunk_size: int
    dtype: str


@dataclasses.dataclass(frozen=True)
class GatedDeltaCase:
    name: str
    lengths: tuple[int, ...]  # tokens per sequence
    start_pos: tuple[int, ...]  # absolute position of each sequence's first token
    num_pad: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    chunk_size: int
    dtype: str  # of q, k and v


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    decode_batch: int  # also max_num_seqs
    decode_prompt_len: int  # decode_batch * decode_prompt_len == step_tokens: one prefill step
    decode_tokens: int
    prefill_prompts: int
    prefill_len: int  # step_tokens (one prompt per step), or step_tokens / prefill_prompts (one step)
    step_tokens: int  # max_num_batched_tokens
    repeats: int  # timed runs of each kind
    bamba: dict[str, Any]  # BambaConfig arguments

    @property
    def max_model_len(self) -> int:
        return max(self.prefill_len, self.decode_prompt_len) + max(self.decode_tokens, 16)


@dataclasses.dataclass(frozen=True)
class Plan:
    copy_bytes: int  # bandwidth probe size
    matmul_size: int  # matmul probe: n x n x n
    roofline_repeats: int
    kernel_repeats: int
    attention: tuple[AttentionCase, ...]
    ssd: tuple[SsdCase, ...]
    selective: tuple[SelectiveCase, ...]
    gated_delta: tuple[GatedDeltaCase, ...]
    engine: EngineSpec
    kernel_case_s: float  # time a kernel case may take (for the deadline)
    engine_build_s: float
    engine_mode_s: float
    startup_s: float


def _lengths(rng: np.random.Generator, n: int, low: int, high: int) -> tuple[int, ...]:
    return tuple(int(v) for v in rng.integers(low, high + 1, n))


def full_plan() -> Plan:
    rng = np.random.default_rng(SEED)
    heads = dict(q_heads=32, kv_heads=8, head_dim=128)
    decode_kv = _lengths(rng, 64, 2048, 8192)
    mixed_kv = (512, 1024, 3000, 4096) + _lengths(rng, 60, 1024, 4096)
    mixed_q = (512, 256, 128, 64) + (1,) * 60
    ssd = dict(head_dim=64, state_size=128, chunk_size=256)
    selective = dict(channels=8192, state_size=16, chunk_size=64, dtype="bfloat16")
    gated_delta = dict(key_heads=16, value_heads=32, key_dim=128, value_dim=128, chunk_size=64, dtype="bfloat16")
    prefill = dict(lengths=(2048,) * 4, start_pos=(0, 0, 256, 1000), num_pad=0)
    decodeish = dict(lengths=_lengths(rng, 64, 1, 8), start_pos=_lengths(rng, 64, 0, 8000), num_pad=16)
    bamba = dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        attn_layer_indices=[4, 9, 14],
        num_attention_heads=16,
        num_key_value_heads=4,
        mamba_n_heads=64,
        mamba_d_head=64,
        mamba_expand=2,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=256,
        max_position_embeddings=4096,
    )
    return Plan(
        copy_bytes=2 * 2**30,
        matmul_size=8192,
        roofline_repeats=10,
        kernel_repeats=20,
        attention=(
            AttentionCase("attention decode bf16", (1,) * 64, decode_kv, 0, **heads),
            AttentionCase("attention mixed bf16", mixed_q, mixed_kv, 4, **heads),
        ),
        ssd=(
            SsdCase("ssd prefill bf16", num_heads=128, num_groups=1, dtype="bfloat16", **prefill, **ssd),
            SsdCase("ssd prefill f32", num_heads=64, num_groups=1, dtype="float32", **prefill, **ssd),
            SsdCase("ssd decode-ish bf16", num_heads=128, num_groups=8, dtype="bfloat16", **decodeish, **ssd),
        ),
        selective=(
            SelectiveCase("selective prefill bf16", **prefill, **selective),
            SelectiveCase("selective decode-ish bf16", **decodeish, **selective),
        ),
        gated_delta=(
            GatedDeltaCase("gated delta prefill bf16", **prefill, **gated_delta),
            GatedDeltaCase("gated delta decode-ish bf16", **decodeish, **gated_delta),
        ),
        engine=EngineSpec(
            decode_batch=64,
            decode_prompt_len=32,
            decode_tokens=128,
            prefill_prompts=8,
            prefill_len=2048,
            step_tokens=2048,
            repeats=3,
            bamba=bamba,
        ),
        kernel_case_s=30,
        engine_build_s=30,
        engine_mode_s=200,
        startup_s=240,
    )


def quick_plan() -> Plan:
    """Tiny shapes with the same structure, for a smoke run (interpret mode on CPU)."""
    heads = dict(q_heads=8, kv_heads=2, head_dim=32)
    ssd = dict(num_heads=2, num_groups=1, head_dim=64, state_size=32, chunk_size=64)
    selective = dict(channels=256, state_size=16, chunk_size=16, dtype="bfloat16")
    gated_delta = dict(key_heads=1, value_heads=2, key_dim=16, value_dim=64, chunk_size=16, dtype="bfloat16")
    bamba = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=2,
        mamba_d_head=64,
        mamba_expand=2,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        max_position_embeddings=256,
    )
    return Plan(
        copy_bytes=32 * 2**20,
        matmul_size=256,
        roofline_repeats=3,
        kernel_repeats=1,
        attention=(
            AttentionCase("attention decode bf16", (1,) * 4, (20, 33, 48, 70), 0, **heads),
            AttentionCase("attention mixed bf16", (9, 5, 1, 1, 1), (9, 30, 10, 17, 40), 3, **heads),
        ),
        ssd=(
            SsdCase("ssd prefill bf16", (40, 30), (0, 50), 0, dtype="bfloat16", **ssd),
            SsdCase("ssd prefill f32", (40, 30), (0, 50), 0, dtype="float32", **ssd),
            SsdCase("ssd decode-ish bf16", (1, 3, 2, 1), (0, 63, 64, 150), 5, dtype="bfloat16", **ssd),
        ),
        selective=(
            SelectiveCase("selective prefill bf16", (40, 30), (0, 50), 0, **selective),
            SelectiveCase("selective decode-ish bf16", (1, 3, 2, 1), (0, 63, 64, 150), 5, **selective),
        ),
        gated_delta=(
            GatedDeltaCase("gated delta prefill bf16", (40, 30), (0, 50), 0, **gated_delta),
            GatedDeltaCase("gated delta decode-ish bf16", (1, 3, 2, 1), (0, 63, 64, 150), 5, **gated_delta),
        ),
        engine=EngineSpec(
            decode_batch=4,
            decode_prompt_len=8,
            decode_tokens=4,
            prefill_prompts=4,
            prefill_len=8,
            step_tokens=32,
            repeats=1,
            bamba=bamba,
        ),
        kernel_case_s=20,
        engine_build_s=5,
        engine_mode_s=30,
        startup_s=120,
    )


# ---------------------------------------------------------------------------- results


@dataclasses.dataclass
class Row:
    """One line of the report. `kernel` / `reference` are times in ms, or throughputs."""

    part: str
    name: str
    status: str  # pass, fail, ok (measurement only), skipped (time), error: ...
    error: float | None = None
    tol: float | None = None
    kernel: float | None = None  # the Pallas kernel, or the engine with kernels="auto"
    reference: float | None = None
    unit: str = ""
    kernel_floor_pct: float | None = None
    reference_floor_pct: float | None = None
    note: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """How many times faster the kernel side is."""
        if self.kernel is None or self.reference is None:
            return None
        if self.unit == "ms":
            return self.reference / self.kernel
        return self.kernel / self.reference if self.unit == "tok/s" else None


@dataclasses.dataclass(frozen=True)
class Roofline:
    bandwidth: float  # bytes/s
    matmul_rate: float  # bf16 FLOP/s

    def floor_s(self, num_bytes: float, flops: float) -> float:
        return max(num_bytes / self.bandwidth, flops / self.matmul_rate)


@dataclasses.dataclass(frozen=True)
class Check:
    """One compared output."""

    name: str
    error: float
    tol: float

    @property
    def ratio(self) -> float:
        return self.error / self.tol if self.tol > 0 else (0.0 if self.error == 0 else math.inf)


class Deadline:
    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.end = self.start + budget_s

    def allows(self, seconds: float) -> bool:
        """Whether a step of about `seconds` still fits."""
        return time.monotonic() + seconds <= self.end

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def error_status(e: Exception) -> str:
    message = str(e).splitlines()[0][:160] if str(e) else ""
    return f"error: {type(e).__name__}: {message}"


def guarded(part: str, name: str, fn: Callable[..., Row | list[Row]], *args: Any) -> list[Row]:
    """Runs `fn(*args)`; an exception becomes an error row (traceback on stderr), so the
    other checks still run."""
    try:
        result = fn(*args)
    except Exception as e:  # one failed check must not end the run
        traceback.print_exc()
        return [Row(part, name, error_status(e))]
    return [result] if isinstance(result, Row) else result


def log(deadline: Deadline, message: str) -> None:
    print(f"[{deadline.elapsed():5.0f} s] {message}", flush=True)


def within(
    deadline: Deadline, seconds: float, part: str, name: str, fn: Callable[..., Row | list[Row]], *args: Any
) -> list[Row]:
    """`guarded(part, name, fn, *args)` where about `seconds` still fit before the deadline,
    else a skipped row; logged either way."""
    rows = guarded(part, name, fn, *args) if deadline.allows(seconds) else [Row(part, name, SKIPPED)]
    log(deadline, f"{name}: {rows[-1].status}")
    return rows


# ---------------------------------------------------------------------------- timing


def random_key() -> jax.Array:
    """The inputs' seed; the "rbg" generator compiles faster than the default threefry."""
    return jax.random.key(SEED, impl="rbg")


def call_times(fn: Callable, args: Sequence, repeats: int) -> list[float]:
    """Seconds of `repeats` calls, each waited for with block_until_ready."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def timed_s(fn: Callable, args: Sequence, repeats: int) -> tuple[Any, float, float]:
    """The first call's result and seconds (compile included), and the median seconds of
    `repeats` further calls."""
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    first = time.perf_counter() - start
    return result, first, statistics.median(call_times(fn, args, repeats))


def measure_roofline(plan: Plan) -> Row:
    """Best HBM bandwidth and bf16 matmul rate; the row's details hold the `Roofline`."""
    x = jnp.ones((plan.copy_bytes // 4,), jnp.float32)
    double = jax.jit(lambda a: a * 2)
    jax.block_until_ready(double(x))
    bandwidth = 2 * x.nbytes / min(call_times(double, (x,), plan.roofline_repeats))
    del x
    n = plan.matmul_size
    a = jax.random.normal(random_key(), (n, n), jnp.bfloat16)
    matmul = jax.jit(jnp.matmul)
    jax.block_until_ready(matmul(a, a))
    rate = 2 * n**3 / min(call_times(matmul, (a, a), plan.roofline_repeats))
    roofline = Roofline(bandwidth, rate)
    note = f"HBM {bandwidth / 1e9:,.0f} GB/s, bf16 matmul {rate / 1e12:.1f} TFLOP/s"
    return Row("roofline", "roofline", "ok", note=note, details=dataclasses.asdict(roofline))


# ---------------------------------------------------------------------------- kernels


def attention_inputs(case: AttentionCase) -> tuple[jax.Array, ...]:
    """q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens; pages shuffled, page 0 the null sink."""
    rng = np.random.default_rng(SEED)
    needed = [-(-kv // case.page_size) for kv in case.kv_lens]
    num_pages = 1 + sum(needed)
    order = rng.permutation(np.arange(1, num_pages, dtype=np.int32))
    page_indices = np.zeros((len(needed), max(needed)), np.int32)
    for s, (first, n) in enumerate(zip(np.cumsum([0, *needed[:-1]]), needed)):
        page_indices[s, :n] = order[first : first + n]
    cu_q_lens = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1]) + case.num_pad
    dtype = jnp.dtype(case.dtype)
    page_shape = (num_pages, case.page_size, case.kv_heads, case.head_dim)

    @jax.jit  # one compile, and drawn on the device
    def draw(key: jax.Array) -> tuple[jax.Array, ...]:
        kq, kk, kv = jax.random.split(key, 3)
        q = Q_SCALE * jax.random.normal(kq, (num_tokens, case.q_heads, case.head_dim), jnp.float32)
        return (
            q.astype(dtype),
            jax.random.normal(kk, page_shape, dtype),
            jax.random.uniform(kv, page_shape, dtype, -1, 1),
        )

    ints = (np.asarray(case.kv_lens, np.int32), page_indices, cu_q_lens)
    return (*draw(random_key()), *(jnp.asarray(a) for a in ints))


def attention_cost(case: AttentionCase) -> tuple[float, float]:
    """(bytes, FLOPs): q, out and each context's keys and values once; QK and PV over visible keys."""
    itemsize = jnp.dtype(case.dtype).itemsize
    num_tokens = sum(case.q_lens) + case.num_pad
    kv_bytes = 2 * sum(case.kv_lens) * case.kv_heads * case.head_dim * itemsize
    visible = sum(q * kv - q * (q - 1) // 2 for q, kv in zip(case.q_lens, case.kv_lens))
    return (
        kv_bytes + 2 * num_tokens * case.q_heads * case.head_dim * itemsize,
        4 * case.q_heads * case.head_dim * visible,
    )


def max_abs(a: jax.Array, b: jax.Array) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def attention_checks(got: jax.Array, want: jax.Array) -> list[Check]:
    return [Check("out", max_abs(got, want), ATTENTION_TOL)]


def ssd_inputs(case: SsdCase) -> tuple[jax.Array, ...]:
    """x, dt, A, B, C, init_states, cu_seqlens, start_pos; dt in [1e-3, 0.1], A in [-16, -1]."""
    num_tokens = sum(case.lengths) + case.num_pad
    h, g, p, n = case.num_heads, case.num_groups, case.head_dim, case.state_size
    dtype, f32 = jnp.dtype(case.dtype), jnp.float32

    @jax.jit  # one compile, and drawn on the device
    def draw(key: jax.Array) -> tuple[jax.Array, ...]:
        kx, kdt, ka, kb, kc, ks = jax.random.split(key, 6)
        return (
            jax.random.normal(kx, (num_tokens, h, p), dtype),
            jnp.exp(jax.random.uniform(kdt, (num_tokens, h), f32, math.log(1e-3), math.log(0.1))),
            -jnp.exp(jax.random.uniform(ka, (h,), f32, 0.0, math.log(16.0))),
            jax.random.normal(kb, (num_tokens, g, n), dtype),
            jax.random.normal(kc, (num_tokens, g, n), dtype),
            jax.random.normal(ks, (len(case.lengths), h, p, n), f32),
        )

    cu_seqlens = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int32)
    return (*draw(random_key()), jnp.asarray(cu_seqlens), jnp.asarray(case.start_pos, jnp.int32))


def ssd_rows(case: SsdCase | SelectiveCase | GatedDeltaCase) -> list[int]:
    """Tokens of each (sequence, absolute chunk) row."""
    rows = []
    for length, start in zip(case.lengths, case.start_pos):
        pos, end = start, start + length
        while pos < end:
            nxt = min((pos // case.chunk_size + 1) * case.chunk_size, end)
            rows.append(nxt - pos)
            pos = nxt
    return rows


def ssd_cost(case: SsdCase) -> tuple[float, float]:
    """(bytes, FLOPs): inputs and init states read, y, chunk states and final states written
    once; per row of L tokens the causal C B^T and scores x products plus the state in/out ones."""
    itemsize = jnp.dtype(case.dtype).itemsize
    h, g, p, n = case.num_heads, case.num_groups, case.head_dim, case.state_size
    num_tokens, num_seqs, rows = sum(case.lengths) + case.num_pad, len(case.lengths), ssd_rows(case)
    state = h * p * n * 4
    inputs = num_tokens * (h * p * itemsize + h * 4 + 2 * g * n * itemsize)
    num_bytes = inputs + num_tokens * h * p * 4 + (2 * num_seqs + len(rows)) * state
    flops = sum(L * (L + 1) // 2 * 2 * (n * g + p * h) + 4 * L * p * n * h for L in rows)
    return num_bytes, flops


def selective_inputs(case: SelectiveCase) -> tuple[jax.Array, ...]:
    """x, dt, A, B, C, init_states, cu_seqlens, start_pos; dt in [1e-3, 0.1], A in [-16, -1]."""
    num_tokens = sum(case.lengths) + case.num_pad
    d, n = case.channels, case.state_size
    dtype, f32 = jnp.dtype(case.dtype), jnp.float32

    @jax.jit  # one compile, and drawn on the device
    def draw(key: jax.Array) -> tuple[jax.Array, ...]:
        kx, kdt, ka, kb, kc, ks = jax.random.split(key, 6)
        return (
            jax.random.normal(kx, (num_tokens, d), dtype),
            jnp.exp(jax.random.uniform(kdt, (num_tokens, d), f32, math.log(1e-3), math.log(0.1))),
            -jnp.exp(jax.random.uniform(ka, (d, n), f32, 0.0, math.log(16.0))),
            jax.random.normal(kb, (num_tokens, n), dtype),
            jax.random.normal(kc, (num_tokens, n), dtype),
            jax.random.normal(ks, (len(case.lengths), d, n), f32),
        )

    cu_seqlens = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int32)
    return (*draw(random_key()), jnp.asarray(cu_seqlens), jnp.asarray(case.start_pos, jnp.int32))


def selective_cost(case: SelectiveCase) -> tuple[float, float]:
    """(bytes, FLOPs): inputs and init states read, y, row and final states written once;
    per token and state entry a decay (one exp), a write and an output term (~6 FLOPs)."""
    itemsize = jnp.dtype(case.dtype).itemsize
    d, n = case.channels, case.state_size
    num_tokens, num_seqs, rows = sum(case.lengths) + case.num_pad, len(case.lengths), ssd_rows(case)
    inputs = num_tokens * (d * itemsize + d * 4 + 2 * n * itemsize)
    num_bytes = inputs + num_tokens * d * 4 + (2 * num_seqs + len(rows)) * d * n * 4
    return num_bytes, 6 * num_tokens * d * n


def ssd_checks(got: RaggedScanOutput, want: RaggedScanOutput) -> list[Check]:
    """The per-token output (y, or the gated delta rule's o), final states and the states of
    used rows within SSD_RTOL of their magnitude; the row layout exactly. (The selective scan's
    and the gated delta rule's outputs have the same fields but the first one's name.)"""
    used = (want.chunk_seq < want.final_states.shape[0]).reshape(-1, *[1] * (want.chunk_states.ndim - 1))
    pairs = {
        want._fields[0]: (got[0], want[0]),
        "final_states": (got.final_states, want.final_states),
        "chunk_states": (jnp.where(used, got.chunk_states, 0), jnp.where(used, want.chunk_states, 0)),
    }
    checks = [Check(k, max_abs(a, b), SSD_RTOL * float(jnp.max(jnp.abs(b)))) for k, (a, b) in pairs.items()]
    same = bool(jnp.array_equal(got.chunk_seq, want.chunk_seq) & jnp.array_equal(got.chunk_end, want.chunk_end))
    return [*checks, Check("row layout", 0.0 if same else 1.0, 0.0)]


def gated_delta_inputs(case: GatedDeltaCase) -> tuple[jax.Array, ...]:
    """q, k (L2-normalised), v, g, beta, init_states, cu_seqlens, start_pos; g in [-0.5, -1e-3]
    (log-uniform), beta in [0, 1]."""
    num_tokens = sum(case.lengths) + case.num_pad
    hk, hv, dk, dv = case.key_heads, case.value_heads, case.key_dim, case.value_dim
    dtype, f32 = jnp.dtype(case.dtype), jnp.float32

    def unit(x: jax.Array) -> jax.Array:
        return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)).astype(dtype)

    @jax.jit  # one compile, and drawn on the device
    def draw(key: jax.Array) -> tuple[jax.Array, ...]:
        kq, kk, kv, kg, kb, ks = jax.random.split(key, 6)
        return (
            unit(jax.random.normal(kq, (num_tokens, hk, dk), f32)),
            unit(jax.random.normal(kk, (num_tokens, hk, dk), f32)),
            jax.random.normal(kv, (num_tokens, hv, dv), dtype),
            -jnp.exp(jax.random.uniform(kg, (num_tokens, hv), f32, math.log(1e-3), math.log(0.5))),
            jax.random.uniform(kb, (num_tokens, hv), f32),
            jax.random.normal(ks, (len(case.lengths), hv, dk, dv), f32),
        )

    cu_seqlens = np.concatenate([[0], np.cumsum(case.lengths)]).astype(np.int32)
    return (*draw(random_key()), jnp.asarray(cu_seqlens), jnp.asarray(case.start_pos, jnp.int32))


def gated_delta_cost(case: GatedDeltaCase) -> tuple[float, float]:
    """(bytes, FLOPs): inputs and init states read, o, row and final states written once; per
    head and row of L tokens the chunked form's causal k k^T and q k^T, its triangular solve
    for [U | W], the correction products with the state (W S, q S, k^T V') and lower(q k^T) V'."""
    itemsize = jnp.dtype(case.dtype).itemsize
    hk, hv, dk, dv = case.key_heads, case.value_heads, case.key_dim, case.value_dim
    num_tokens, num_seqs, rows = sum(case.lengths) + case.num_pad, len(case.lengths), ssd_rows(case)
    inputs = num_tokens * (2 * hk * dk * itemsize + hv * dv * itemsize + 2 * hv * 4)
    num_bytes = inputs + num_tokens * hv * dv * 4 + (2 * num_seqs + len(rows)) * hv * dk * dv * 4
    per_head = sum(2 * L * (L + 1) * dk + L * (L - 1) * (dk + dv) + 6 * L * dk * dv + L * (L + 1) * dv for L in rows)
    return num_bytes, hv * per_head


def kernel_row(
    name: str,
    kernel: Callable,
    reference: Callable,
    args: tuple[jax.Array, ...],
    checks: Callable[[Any, Any], list[Check]],
    cost: tuple[float, float],
    roofline: Roofline | None,
    repeats: int,
) -> Row:
    """Correctness against the float32-precision reference, then both timed."""
    with jax.default_matmul_precision("highest"):
        want = reference(*args)
    got, kernel_first, kernel_s = timed_s(kernel, args, repeats)
    results = checks(got, want)
    del got, want
    _, reference_first, reference_s = timed_s(reference, args, repeats)
    worst = max(results, key=lambda c: c.ratio)
    floor = roofline.floor_s(*cost) if roofline else None
    return Row(
        "kernels",
        name,
        "pass" if all(c.ratio <= 1 for c in results) else "fail",
        error=worst.error,
        tol=worst.tol,
        kernel=kernel_s * 1e3,
        reference=reference_s * 1e3,
        unit="ms",
        kernel_floor_pct=100 * floor / kernel_s if floor else None,
        reference_floor_pct=100 * floor / reference_s if floor else None,
        note=f"worst: {worst.name}",
        details={
            "checks": [dataclasses.asdict(c) for c in results],
            "bytes": cost[0],
            "flops": cost[1],
            "floor_ms": floor * 1e3 if floor else None,
            "kernel_first_call_s": kernel_first,
            "reference_first_call_s": reference_first,
            "repeats": repeats,
        },
    )


def attention_row(case: AttentionCase, roofline: Roofline | None, repeats: int, interpret: bool) -> Row:
    static = dict(sm_scale=case.head_dim**-0.5)
    kernel = jax.jit(functools.partial(attention_gpu.ragged_paged_attention, **static, interpret=interpret))
    reference = jax.jit(functools.partial(ragged_paged_attention, **static))
    args = attention_inputs(case)
    row = kernel_row(case.name, kernel, reference, args, attention_checks, attention_cost(case), roofline, repeats)
    row.details["case"] = dataclasses.asdict(case)
    return row


def ssd_row(case: SsdCase, roofline: Roofline | None, repeats: int, interpret: bool) -> Row:
    kernel = jax.jit(functools.partial(ssd_gpu.ragged_ssd_scan, chunk_size=case.chunk_size, interpret=interpret))
    reference = jax.jit(functools.partial(ragged_ssd_scan, chunk_size=case.chunk_size))
    args = ssd_inputs(case)
    row = kernel_row(case.name, kernel, reference, args, ssd_checks, ssd_cost(case), roofline, repeats)
    row.details["case"] = dataclasses.asdict(case)
    return row


def selective_row(case: SelectiveCase, roofline: Roofline | None, repeats: int, interpret: bool) -> Row:
    static = dict(chunk_size=case.chunk_size)
    kernel = jax.jit(functools.partial(selective_gpu.ragged_selective_scan, **static, interpret=interpret))
    reference = jax.jit(functools.partial(ragged_selective_scan, **static))
    args = selective_inputs(case)
    row = kernel_row(case.name, kernel, reference, args, ssd_checks, selective_cost(case), roofline, repeats)
    row.details["case"] = dataclasses.asdict(case)
    return row


def gated_delta_row(case: GatedDeltaCase, roofline: Roofline | None, repeats: int, interpret: bool) -> Row:
    static = dict(chunk_size=case.chunk_size, scale=case.key_dim**-0.5)
    kernel = jax.jit(functools.partial(gated_delta_gpu.ragged_gated_delta, **static, interpret=interpret))
    reference = jax.jit(functools.partial(ragged_gated_delta, **static))
    args = gated_delta_inputs(case)
    row = kernel_row(case.name, kernel, reference, args, ssd_checks, gated_delta_cost(case), roofline, repeats)
    row.details["case"] = dataclasses.asdict(case)
    return row


def kernel_rows(plan: Plan, roofline: Roofline | None, deadline: Deadline, interpret: bool) -> list[Row]:
    cases: list[tuple[Any, Callable[..., Row]]] = [(c, attention_row) for c in plan.attention]
    cases += [(c, ssd_row) for c in plan.ssd]
    cases += [(c, selective_row) for c in plan.selective]
    cases += [(c, gated_delta_row) for c in plan.gated_delta]
    rows = []
    for case, check in cases:
        rows += within(
            deadline, plan.kernel_case_s, "kernels", case.name, check, case, roofline, plan.kernel_repeats, interpret
        )
    return rows


# ---------------------------------------------------------------------------- engine


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    parameters: int
    weight_bytes: int  # all weights (bf16)
    embedding_bytes: int  # the input embedding (a decode step reads a few rows of it)
    layer_parameters: int  # weights of the layers (each token's matmuls use them all)


@dataclasses.dataclass(frozen=True)
class EngineRun:
    """One kernels= mode: medians of the timed runs."""

    kernels: str
    load_s: float
    first_runs_s: float  # the untimed decode and prefill runs: compiles every timed shape
    decode_tokens_per_s: float  # batch / mean time per output token
    output_tokens_per_s: float  # batch * max_tokens / generate wall time (prefill included)
    prefill_tokens_per_s: float  # prompt tokens / generate wall time (one output token each)
    sync_output_tokens_per_s: float  # output_tokens_per_s of the same decode runs, async scheduling off
    recompiles: int  # step compilations during the timed runs (should be 0)
    decode_outputs: list[list[int]]  # greedy tokens of the first decode run
    prefill_outputs: list[int]  # and the first prefill run's tokens
    # Where a step's time goes (`step_timeline.py`: host before dispatch, dispatch, device
    # wait, host after, the device's idle gap; medians, ms) in the timed decode and prefill runs.
    decode_timeline: dict = dataclasses.field(default_factory=dict)
    prefill_timeline: dict = dataclasses.field(default_factory=dict)
    # The device operations that took the most time in a profiled decode run.
    top_device_ops: list[dict] = dataclasses.field(default_factory=list)


def random_weight(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norms and D one, A in [-16, -1], dt ~ softplus(-3) = 0.05, embeddings N(0, 1), an lm_head
    that spreads the logits (std ~4.5, so greedy picks are rarely near-ties), else N(0, 0.02)."""
    import torch

    if name.endswith(("norm.weight", ".D")):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("dt_bias"):
        return (-3.0 + 0.3 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    if name.endswith("A_log"):
        return torch.log(1 + 15 * torch.rand(shape, generator=gen)).to(torch.bfloat16)
    std = 1.0 if "embed_tokens" in name else 0.1 if name.startswith("lm_head") else 0.02
    return (std * torch.randn(shape, generator=gen)).to(torch.bfloat16)


def build_random_bamba(path: Path, spec: EngineSpec) -> ModelSizes:
    """Saves a seeded random bf16 Bamba (config.json and model.safetensors) to `path`.

    torch (imported by transformers and jaxengine too) is imported only once JAX has set up
    its GPU backend: torch loads its own cuDNN, the first copy loaded wins, and JAX does not
    start its GPU backend on an older one."""
    import torch
    from safetensors.torch import save_file
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        **spec.bamba,
        architectures=["BambaForCausalLM"],
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in BambaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(SEED)
    save_file({k: random_weight(k, s, gen) for k, s in shapes.items()}, path / "model.safetensors", {"format": "pt"})
    config.save_pretrained(path)
    numel = {k: math.prod(s) for k, s in shapes.items()}
    return ModelSizes(
        parameters=sum(numel.values()),
        weight_bytes=2 * sum(numel.values()),
        embedding_bytes=2 * sum(v for k, v in numel.items() if "embed_tokens" in k),
        layer_parameters=sum(v for k, v in numel.items() if ".layers." in k),
    )


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    return np.random.default_rng(seed).integers(1, vocab, (count, length)).tolist()


def run_engine(model_dir: Path, kernels: str, spec: EngineSpec, tensor_parallel_size: int = 1) -> EngineRun:
    """Loads the model, runs decode and prefill once untimed (compiling their shapes), then
    `spec.repeats` timed runs of each, every run with fresh prompts (no prefix-cache hits)."""
    from jaxengine import LLM, SamplingParams  # after JAX's GPU start-up (see build_random_bamba)

    vocab = spec.bamba["vocab_size"]
    decode = SamplingParams(max_tokens=spec.decode_tokens, temperature=0.0, ignore_eos=True)
    prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm = LLM(
        model_dir,
        dtype="bfloat16",
        kernels=kernels,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.decode_batch,
        max_num_batched_tokens=spec.step_tokens,
        warm_up=False,
        compilation_cache_dir=None,
        tensor_parallel_size=tensor_parallel_size,
    )
    load_s = time.perf_counter() - start

    def run(params: SamplingParams, count: int, length: int, seed: int) -> tuple[float, list[RequestOutput]]:
        prompts = random_prompts(count, length, vocab, seed)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outs

    start = time.perf_counter()
    first_decode = run(decode, spec.decode_batch, spec.decode_prompt_len, SEED)[1]
    first_prefill = run(prefill, spec.prefill_prompts, spec.prefill_len, SEED + 1)[1]
    first_runs_s = time.perf_counter() - start
    compiled = llm.engine.runner.num_compiled_steps()
    walls, step_s, prefill_walls = [], [], []
    timelines: dict[str, list[dict]] = {"decode": [], "prefill": []}
    for i in range(spec.repeats):
        llm.engine.timeline.reset()
        wall, outs = run(decode, spec.decode_batch, spec.decode_prompt_len, SEED + 100 + i)
        timelines["decode"].append(llm.engine.timeline.as_dict())
        walls.append(wall)
        step_s.append(statistics.mean(o.time_per_output_token for o in outs))
        llm.engine.timeline.reset()
        prefill_walls.append(run(prefill, spec.prefill_prompts, spec.prefill_len, SEED + 200 + i)[0])
        timelines["prefill"].append(llm.engine.timeline.as_dict())
    # The same decode runs with the synchronous loop: what overlapping host and device buys.
    engine = llm.engine
    engine.config = dataclasses.replace(engine.config, async_scheduling=False)
    sync_walls = [
        run(decode, spec.decode_batch, spec.decode_prompt_len, SEED + 400 + i)[0] for i in range(spec.repeats)
    ]
    engine.config = dataclasses.replace(engine.config, async_scheduling=True)
    recompiles = llm.engine.runner.num_compiled_steps() - compiled
    top_ops = []
    if kernels != "reference":  # what the device spends a decode step on, from a profiler trace
        with tempfile.TemporaryDirectory() as trace_dir:
            jax.profiler.start_trace(trace_dir)
            try:
                profiled = SamplingParams(max_tokens=min(8, spec.decode_tokens), temperature=0.0, ignore_eos=True)
                run(profiled, spec.decode_batch, spec.decode_prompt_len, SEED + 300)
            finally:
                jax.profiler.stop_trace()
            top_ops = top_device_ops(Path(trace_dir))
    med = statistics.median
    return EngineRun(
        kernels=kernels,
        load_s=load_s,
        first_runs_s=first_runs_s,
        decode_tokens_per_s=spec.decode_batch / med(step_s),
        output_tokens_per_s=spec.decode_batch * spec.decode_tokens / med(walls),
        prefill_tokens_per_s=spec.prefill_prompts * spec.prefill_len / med(prefill_walls),
        sync_output_tokens_per_s=spec.decode_batch * spec.decode_tokens / med(sync_walls),
        recompiles=recompiles,
        decode_outputs=[o.outputs[0].token_ids for o in first_decode],
        prefill_outputs=[o.outputs[0].token_ids[0] for o in first_prefill],
        decode_timeline=median_timeline(timelines["decode"]),
        prefill_timeline=median_timeline(timelines["prefill"]),
        top_device_ops=top_ops,
    )


def print_where_time_goes(run: EngineRun) -> None:
    """The step timelines and the top device operations, as soon as a mode has run."""
    for kind, timeline in (("decode", run.decode_timeline), ("prefill", run.prefill_timeline)):
        figures = ", ".join(f"{k.removeprefix('step_')} {v:.3f}" for k, v in timeline.items())
        print(f"    {kind} steps (ms, medians): {figures}", flush=True)
    for op in run.top_device_ops[:10]:
        print(f"    {op['share']:6.1%} {op['total_ms']:9.2f} ms {op['calls']:6d} x  {op['name'][:90]}", flush=True)


def median_timeline(runs: list[dict]) -> dict:
    """Each timeline figure's median over the timed runs."""
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]} if runs else {}


def top_device_ops(trace_dir: Path, count: int = 15) -> list[dict]:
    """The operations that took the most time in a JAX profiler trace: on a GPU or TPU the
    device planes' op events (their "XLA Ops" lines where there are such), on a CPU the XLA
    threads of the host plane. Each: name, total ms, calls and share of the total."""
    from jax.profiler import ProfileData

    totals: dict[str, list[float]] = {}
    for path in trace_dir.rglob("*.xplane.pb"):
        planes = list(ProfileData.from_file(str(path)).planes)
        devices = [p for p in planes if p.name.startswith("/device:")]
        for plane in devices or [p for p in planes if p.name == "/host:CPU"]:
            lines = list(plane.lines)
            ops = [line for line in lines if line.name == "XLA Ops"]
            chosen = ops or ([line for line in lines if "XLA" in line.name] if not devices else lines)
            for line in chosen:
                for event in line.events:
                    entry = totals.setdefault(event.name, [0.0, 0])
                    entry[0] += event.duration_ns / 1e6
                    entry[1] += 1
    whole = sum(ms for ms, _ in totals.values()) or 1.0
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:count]
    return [{"name": name, "total_ms": ms, "calls": calls, "share": ms / whole} for name, (ms, calls) in top]


# Speculative decoding's verify steps: ngram drafts (host-side, so the row times the verify
# steps themselves) on prompts that repeat a pattern, drafting at every step.
VERIFY_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}


def periodic_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts repeating a random 8-token pattern, so that prompt lookup finds drafts."""
    patterns = np.random.default_rng(seed).integers(1, vocab, (count, 8))
    return np.tile(patterns, (1, -(-length // 8)))[:, :length].tolist()


def draft_config(model_dir: Path) -> dict:
    """The random model drafting for itself: every greedy draft should be accepted."""
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3, "adaptive": False}


def verify_row(model_dir: Path, kernels: str, spec: EngineSpec, method: str = "ngram") -> Row:
    """One engine speculating with `method` (ngram, or `draft_config`), its decode runs with
    drafts (verify steps) and without (plain decode steps), alternating on fresh prompts:
    output tokens/s of each, and the share of requests whose greedy tokens differ between the
    two on the same prompts (the second run of those hits the prefix cache)."""
    from jaxengine import LLM, SamplingParams  # after JAX's GPU start-up (see build_random_bamba)

    config = VERIFY_CONFIG if method == "ngram" else draft_config(model_dir)

    llm = LLM(
        model_dir,
        dtype="bfloat16",
        kernels=kernels,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.decode_batch,
        max_num_batched_tokens=spec.step_tokens,
        warm_up=False,
        compilation_cache_dir=None,
        speculative_config=config,
    )
    engine = llm.engine
    drafter = engine.spec.propose
    params = SamplingParams(max_tokens=spec.decode_tokens, temperature=0.0, ignore_eos=True)
    vocab = spec.bamba["vocab_size"]

    def run(drafts: bool, seed: int) -> tuple[float, list[list[int]]]:
        engine.spec.propose = drafter if drafts else (lambda seq, limit: [])
        prompts = periodic_prompts(spec.decode_batch, spec.decode_prompt_len, vocab, seed)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    plain_tokens, spec_tokens = run(False, SEED)[1], run(True, SEED)[1]  # also compiles both kinds of step
    compiled = engine.runner.num_compiled_steps()
    before = llm.stats()
    walls: dict[bool, list[float]] = {False: [], True: []}
    for i in range(spec.repeats):
        for drafts in (False, True):
            walls[drafts].append(run(drafts, SEED + 300 + i)[0])
    after = llm.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    verifies = after["spec_verifies"] - before["spec_verifies"]
    mismatch = sum(a != b for a, b in zip(plain_tokens, spec_tokens)) / len(plain_tokens)
    rate = spec.decode_batch * spec.decode_tokens
    speeds = {d: rate / statistics.median(w) for d, w in walls.items()}
    length = 1 + accepted / verifies if verifies else 1.0
    recompiles = engine.runner.num_compiled_steps() - compiled  # drafts depend on the tokens: may be > 0
    return Row(
        "engine",
        verify_name(method, spec),
        "pass" if mismatch <= FIRST_TOKEN_TOL and verifies else "fail",
        error=mismatch,
        tol=FIRST_TOKEN_TOL,
        kernel=speeds[True],
        reference=speeds[False],
        unit="tok/s",
        note=f"k=3 {method}, acceptance {accepted / drafted if drafted else 0:.2f}, mean accepted length {length:.2f}"
        + (f", {recompiles} steps compiled while timed" if recompiles else ""),
        details={
            "config": config,
            "kernels": kernels,
            "verifies": verifies,
            "drafted": drafted,
            "accepted": accepted,
            "recompiles": recompiles,
        },
    )


def verify_name(method: str, spec: EngineSpec) -> str:
    return f"engine verify b{spec.decode_batch}" + ("" if method == "ngram" else f" {method}")


def decode_floor_tokens_per_s(spec: EngineSpec, sizes: ModelSizes, roofline: Roofline) -> float:
    """Batch / the time to move what a decode step must: every weight but the input
    embedding, each sequence's float32 SSM states (read and written) and its keys and values."""
    b = spec.bamba
    attention_layers = len(b["attn_layer_indices"])
    state = b["mamba_n_heads"] * b["mamba_d_head"] * b["mamba_d_state"] * 4
    context = spec.decode_prompt_len + spec.decode_tokens / 2
    head_dim = b["hidden_size"] // b["num_attention_heads"]
    kv = attention_layers * context * b["num_key_value_heads"] * head_dim * 2 * 2
    per_seq = (b["num_hidden_layers"] - attention_layers) * 2 * state + kv
    step_bytes = sizes.weight_bytes - sizes.embedding_bytes + spec.decode_batch * per_seq
    return spec.decode_batch / roofline.floor_s(step_bytes, 0.0)


def prefill_floor_tokens_per_s(spec: EngineSpec, sizes: ModelSizes, roofline: Roofline) -> float:
    """Prompt tokens / the time for their FLOPs: 2 per layer weight per token, plus causal attention."""
    b = spec.bamba
    length = spec.prefill_len
    head_dim = b["hidden_size"] // b["num_attention_heads"]
    attention = len(b["attn_layer_indices"]) * 4 * b["num_attention_heads"] * head_dim * length * (length + 1) // 2
    flops = spec.prefill_prompts * (2 * sizes.layer_parameters * length + attention)
    return spec.prefill_prompts * length / roofline.floor_s(0.0, flops)


def first_token_row(auto: EngineRun, reference: EngineRun) -> Row:
    """Same prompts in both modes: the share of requests whose first greedy token differs,
    and how many decode tokens agree before the first difference (information only)."""
    firsts = [(a[0], r[0]) for a, r in zip(auto.decode_outputs, reference.decode_outputs)]
    firsts += list(zip(auto.prefill_outputs, reference.prefill_outputs))
    mismatch = sum(a != r for a, r in firsts) / len(firsts)
    prefix = statistics.mean(
        next((i for i, (x, y) in enumerate(zip(a, r)) if x != y), len(a))
        for a, r in zip(auto.decode_outputs, reference.decode_outputs)
    )
    return Row(
        "engine",
        "engine first tokens auto vs ref",
        "pass" if mismatch <= FIRST_TOKEN_TOL else "fail",
        error=mismatch,
        tol=FIRST_TOKEN_TOL,
        note=f"mean common prefix {prefix:.1f} tokens",
        details={"requests": len(firsts), "mean_common_prefix": prefix},
    )


def tensor_parallel_row(model_dir: Path, kernels: str, spec: EngineSpec, one: EngineRun | str) -> Row:
    """With several devices: the engine over as many as the model's heads split evenly over,
    its first greedy tokens against one device's (`one`) and both decode rates."""
    from jaxengine.engine.mesh import Parallelism  # after JAX's GPU start-up (see build_random_bamba)
    from jaxengine.models.arch import load_model_config

    cfg = load_model_config(model_dir)
    sizes = [tp for tp in range(jax.device_count(), 1, -1) if _splits(Parallelism(tp), cfg)]
    if not sizes or isinstance(one, str):
        return Row("engine", "engine tensor parallel", "skipped (one device)" if not sizes else one)
    run = run_engine(model_dir, kernels, spec, tensor_parallel_size=sizes[0])
    same = first_token_row(run, one)  # tp devices against one
    return dataclasses.replace(
        same,
        name="engine tensor parallel",
        kernel=run.decode_tokens_per_s,
        reference=one.decode_tokens_per_s,
        unit="tok/s",
        note=f"tp{sizes[0]} vs one device: {same.note}; decode tok/s",
        details={**same.details, "tensor_parallel_size": sizes[0]},
    )


def _splits(parallelism: Any, cfg: Any) -> bool:
    try:
        parallelism.validate(cfg)
        return True
    except ValueError:
        return False


def engine_report(
    spec: EngineSpec, sizes: ModelSizes, runs: dict[str, EngineRun | str], roofline: Roofline | None
) -> list[Row]:
    """Rows from the two modes' runs; a mode that did not run is a status string instead."""
    auto, ref = (run if isinstance(run, EngineRun) else None for run in (runs["auto"], runs["reference"]))
    status = "ok" if auto else runs["auto"]
    note = f"reference: {runs['reference']}" if auto and not ref else ""
    floors = {}
    if roofline and sizes.parameters:
        floors = {
            "decode_tokens_per_s": decode_floor_tokens_per_s(spec, sizes, roofline),
            "prefill_tokens_per_s": prefill_floor_tokens_per_s(spec, sizes, roofline),
        }
    rows = []
    for name, attr, unit in (
        (f"engine decode b{spec.decode_batch}", "decode_tokens_per_s", "tok/s"),
        (f"engine prefill {spec.prefill_prompts}x{spec.prefill_len}", "prefill_tokens_per_s", "tok/s"),
        ("engine load / first runs", "first_runs_s", "s"),
    ):
        k, r, floor = getattr(auto, attr, None), getattr(ref, attr, None), floors.get(attr)
        pct = {"kernel_floor_pct": 100 * k / floor if floor and k else None}
        pct["reference_floor_pct"] = 100 * r / floor if floor and r else None
        rows.append(Row("engine", name, status, kernel=k, reference=r, unit=unit, note=note, **pct))
    rows[0].details = {"floor_tokens_per_s": floors, "model": dataclasses.asdict(sizes) | {"config": spec.bamba}}
    rows[0].details["spec"] = {k: v for k, v in dataclasses.asdict(spec).items() if k != "bamba"}
    for run, label in ((auto, "auto"), (ref, "reference")):
        if run:
            rows[0].details[label] = {k: v for k, v in dataclasses.asdict(run).items() if not k.endswith("outputs")}
            if run.recompiles:
                rows[0].note = f"{rows[0].note}; {label} recompiled during timing".lstrip("; ")
    loads = [f"{run.load_s:.1f}" for run in (auto, ref) if run]
    rows[-1].note = f"load {' / '.join(loads)} s" if loads else note
    rows.append(
        Row(
            "engine",
            f"engine output b{spec.decode_batch}, async vs synchronous loop",
            status,
            kernel=getattr(auto, "output_tokens_per_s", None),
            reference=getattr(auto, "sync_output_tokens_per_s", None),
            unit="tok/s",
            note="kernels auto; reference column: async_scheduling off" if auto else "",
        )
    )
    if auto and ref:
        rows.append(first_token_row(auto, ref))
    else:
        rows.append(Row("engine", "engine first tokens auto vs ref", runs["reference"] if auto else status))
    return rows


def engine_rows(
    plan: Plan, roofline: Roofline | None, deadline: Deadline, interpret: bool, parts: Sequence[str]
) -> list[Row]:
    """The engine's rows (`engine` in `parts`: decode, prefill, first tokens, tensor
    parallel) and the verify rows (`verify`), all on one random model."""
    spec = plan.engine
    methods = ("ngram", "draft_model") if "verify" in parts else ()
    measure = "engine" in parts
    if not deadline.allows(plan.engine_build_s + plan.engine_mode_s):
        skipped = []
        if measure:
            skipped = engine_report(spec, ModelSizes(0, 0, 0, 0), {"auto": SKIPPED, "reference": SKIPPED}, roofline)
            skipped.append(Row("engine", "engine tensor parallel", SKIPPED))
        return [*skipped, *(Row("engine", verify_name(m, spec), SKIPPED) for m in methods)]
    modes = {"auto": "pallas-interpret-gpu" if interpret else "auto", "reference": "reference"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        sizes = build_random_bamba(model_dir, spec)
        log(deadline, f"random Bamba saved: {sizes.parameters / 1e6:,.1f}M parameters")
        rows = measured_engine_rows(plan, model_dir, sizes, modes, roofline, deadline, interpret) if measure else []
        for method in methods:
            rows += within(
                deadline,
                plan.engine_mode_s,
                "engine",
                verify_name(method, spec),
                verify_row,
                model_dir,
                modes["auto"],
                spec,
                method,
            )
            gc.collect()
    return rows


def measured_engine_rows(
    plan: Plan,
    model_dir: Path,
    sizes: ModelSizes,
    modes: dict[str, str],
    roofline: Roofline | None,
    deadline: Deadline,
    interpret: bool,
) -> list[Row]:
    """Decode and prefill in both kernel modes, their first tokens compared, and the
    tensor-parallel row."""
    spec = plan.engine
    runs: dict[str, EngineRun | str] = {}
    for label, kernels in modes.items():
        if not deadline.allows(plan.engine_mode_s):
            runs[label] = SKIPPED
            continue
        try:
            runs[label] = run_engine(model_dir, kernels, spec)
        except Exception as e:  # report it, and still run the other mode
            traceback.print_exc()
            runs[label] = error_status(e)
        gc.collect()  # frees the model and pools before the next mode
        status = runs[label] if isinstance(runs[label], str) else "done"
        log(deadline, f"engine kernels={kernels}: {status}")
        if isinstance(runs[label], EngineRun):
            print_where_time_goes(runs[label])
    rows = engine_report(spec, sizes, runs, roofline)
    # Interpreted, the GPU kernels cannot run on several CPU devices at once (the
    # interpreter's shared memory is not per device): the references run under tp there.
    tp_mode = "reference" if interpret else "auto"
    rows += within(
        deadline,
        plan.engine_mode_s,
        "engine",
        "engine tensor parallel",
        tensor_parallel_row,
        model_dir,
        modes[tp_mode],
        spec,
        runs[tp_mode],
    )
    gc.collect()
    return rows


STARTUP = "startup default model"
STARTUP_SHAPE_ROUNDS = 5  # rounds of every shape's step, timed for `bench_shapes.report`


def startup_row() -> Row:
    """The default model started as a user starts it; see the module docstring, part 5."""
    from jaxengine import LLM, SamplingParams  # after JAX's GPU start-up (see build_random_bamba)
    from jaxengine.run_config import DEFAULT_MODEL

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_shapes  # beside this script; imports jaxengine

    start = time.perf_counter()
    llm = LLM(DEFAULT_MODEL, compilation_cache_dir=None)
    ready = time.perf_counter() - start
    llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    first = time.perf_counter() - start
    steps = llm.engine.runner.steps
    steps.wait()
    every = time.perf_counter() - start
    compiles = sorted(steps.compile_seconds.items(), key=lambda item: -item[1])
    slowest = "; ".join(f"{key} {seconds:.1f} s" for key, seconds in compiles[:3])
    # Which shapes buy nothing here: each shape's step against the shape it falls back to.
    shapes = bench_shapes.report(
        bench_shapes.shape_costs(llm, STARTUP_SHAPE_ROUNDS), steps.compile_seconds, bench_shapes.MARGIN
    )
    nothing = [r["shape"] for r in shapes if r["buys_nothing"]]
    return Row(
        "startup",
        STARTUP,
        "ok",
        kernel=first,
        unit="s",
        note=f"LLM() {ready:.1f} s, 16 tokens out {first:.1f} s, all {len(steps.ready)} shapes {every:.1f} s; "
        f"slowest (tokens, seqs, saves, decode): {slowest}; {len(nothing)} shapes buy nothing",
        details={
            "ready_s": ready,
            "first_output_s": first,
            "all_shapes_s": every,
            "compile_seconds": {str(key): seconds for key, seconds in compiles},
            "shapes": shapes,
            "shapes_buying_nothing": nothing,
        },
    )


# ---------------------------------------------------------------------------- report


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "tok/s":
        return f"{value:,.0f} tok/s"
    return f"{value:.3g} {unit}"


def format_table(rows: list[Row]) -> str:
    header = ("check", "status", "error (tol)", "kernel / auto", "reference", "speedup", "% of floor", "note")
    lines = [header]
    for r in rows:
        err = f"{r.error:.2e} ({r.tol:.1e})" if r.error is not None else ""
        pct = " / ".join("-" if p is None else f"{p:.0f}%" for p in (r.kernel_floor_pct, r.reference_floor_pct))
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else ""
        measured = r.kernel is not None or r.reference is not None
        kernel, reference = (fmt(v, r.unit) if measured else "" for v in (r.kernel, r.reference))
        has_pct = r.kernel_floor_pct is not None or r.reference_floor_pct is not None
        lines.append((r.name, r.status[:48], err, kernel, reference, speedup, pct if has_pct else "", r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run; interpret mode without a GPU)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of: " + ", ".join(PARTS))
    parser.add_argument("--json", type=Path, default=Path("device_check.json"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="deadline; later parts are skipped past it")
    args = parser.parse_args(argv)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = Deadline(args.budget_s)
    plan = quick_plan() if args.quick else full_plan()
    device = jax.devices()[0]  # starts the backend before anything imports torch
    interpret = jax.default_backend() != "gpu"
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)
    if interpret and not args.quick:
        print("no GPU backend: the full check needs one (run --quick for a smoke run)", file=sys.stderr)
        return 2
    if interpret:
        print("no GPU: the kernels run in interpret mode (timings are not meaningful)", flush=True)
    rows: list[Row] = []
    roofline_rows = guarded("roofline", "roofline", measure_roofline, plan)
    roofline = Roofline(**roofline_rows[0].details) if roofline_rows[0].status == "ok" else None
    rows += roofline_rows
    log(deadline, f"roofline: {roofline_rows[0].note or roofline_rows[0].status}")
    if "kernels" in args.parts:
        rows += kernel_rows(plan, roofline, deadline, interpret)
    if {"engine", "verify"} & set(args.parts):
        rows += guarded("engine", "engine", engine_rows, plan, roofline, deadline, interpret, args.parts)
    if "startup" in args.parts:
        rows += within(deadline, plan.startup_s, "startup", STARTUP, startup_row)
    passed = not any(r.status == "fail" or r.status.startswith("error") for r in rows)
    report = {
        "device": device.device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "interpret": interpret,
        "parts": args.parts,
        "budget_s": args.budget_s,
        "elapsed_s": deadline.elapsed(),
        "passed": passed,
        "rows": [dataclasses.asdict(r) | {"speedup": r.speedup} for r in rows],
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json} ({report['elapsed_s']:.0f} s)\n")
    print(format_table(rows))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
