"""Pallas Mosaic GPU kernel for the ragged Mamba2 SSD scan; drop-in for `reference.ragged_ssd_scan`.

Backend: Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`, Hopper wgmma), not the Triton
backend that JAX deprecates from 0.11. Mosaic GPU lowers and exports (`jax.export`,
platforms=["cuda"]) on a CPU-only machine with jax 0.10.2, including its layout checks and
its 227 KiB shared-memory check. `interpret=True` runs the kernel on CPU in Mosaic GPU's
interpreter (`InterpretGPUParams`, which jax 0.10.2 only has under `jax._src`). That
interpreter implements neither `plgpu.layout_cast` nor transposed wgmma operands, so in
interpret mode the kernel drops its layout annotations (they only pin register layouts) and
copies transposed operands out explicitly; the arithmetic is the same.

Semantics are the reference's: chunks aligned to absolute positions, never crossing
sequences, each sequence restarting from its initial state, and outputs y [T, H, P],
final_states [S, H, P, N] and the state after every chunk row, with the same row layout
(`chunk_seq`, `chunk_end`, computed by `ragged.scan_rows` with the reference's formulas).
Every row is a contiguous range of at most chunk_size flat tokens and rows come in token
order. The within-row cumulative log-decay cum[t] = sum_{u <= t in t's row} dt[u] * A is an
O(T * H) segmented scan in XLA (`_layout.row_decays`).

Kernel. One CTA (one warpgroup) per (head, 64-wide slice of P): it walks all rows in order,
carrying its [64, N] slice of the state in registers, restarting it from init_states at
each sequence's first row. A row is processed in 64-token tiles of the flat token axis
(aligned, so TMA copies land in MMA-tiled shared memory; T is zero-padded to a multiple of
64 when it is not one), visiting only the tiles the row touches; tokens of a tile outside
the row are removed with selects before any product, so neighbouring rows and padding
garbage (even NaN) cannot leak. For query tile l and key tiles s <= l:
    y_l  = sum_s (C_l B_s^T * exp(cum_l - cum_s) * dt_s) x_s + (C_l * exp(cum_l)) S^T
and after the row
    S'   = exp(cum_last) S + sum_s (x_s * dt_s exp(cum_last - cum_s))^T B_s,
every product a wgmma with M = 64 (a token tile or the P slice). S' is written to
chunk_states[row]. A y tile is stored once complete (later rows start at the row's end); the
tile a row ends inside stays in shared memory and the next row, which starts in it, adds its
part before storing it. Tiles past the last real token are written as zeros.

Numerics. wgmma takes 16-bit operands here; every operand that is not exactly a bfloat16
input value is split as v = hi + lo (two bfloat16 values) and a product a b is formed as
a_hi b_hi + a_hi b_lo + a_lo b_hi, accumulated in float32: about 2^-16 relative error per
product, i.e. float32-reference accuracy (plain tf32 or bfloat16 operands would give 1e-3 to
1e-2). bfloat16 inputs need no split of x, B or C, which saves MMAs.

Block choices (realistic H = 64-128, P = 64, N = 128, chunk 256, G = 1-8): grid (H, P / 64)
gives 64-256 CTAs, about one wave on an H100 / H200 (132 SMs). Tiles are 64 tokens (the
wgmma M granule): a chunk-aligned 256-token row costs 10 tile pairs where a dense chunk
costs 16, and a one-token row costs one. Shared memory for N = 128: 193 KiB with float32
inputs, 201 KiB with bfloat16 ones (mostly the hi / lo operand tiles), of the 227 KiB a
block may use; hence N <= 128. Requires P a multiple of 64 and N a multiple of 16. Copies
are synchronous (no prefetching) and each key tile is fetched once per query tile: the
kernel favours simplicity over overlap. Checked and timed on an H200 by
`scripts/device_check.py` (BENCHMARKS.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu, ragged
from pallas_kernels.ssd import _layout
from pallas_kernels.ssd.reference import RaggedScanOutput

TILE = 64  # tokens per tile, and the width of a P slice: the wgmma M granule
MAX_STATE_SIZE = 128  # shared-memory budget (see the module docstring)

_WGMMA = plgpu.Layout.WGMMA
_PER_ROW = _WGMMA.reduce(1)  # [64] vector indexed like the rows of a WGMMA [64, n] array
_PER_COL = _WGMMA.reduce(0)  # [64] vector indexed like its columns


def _smem(shape: tuple[int, ...], dtype) -> plgpu.SMEM:
    """Shared memory tiled and swizzled for wgmma operands and TMA copies."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = next(s for s in (128, 64, 32) if shape[-1] * itemsize % s == 0)
    return plgpu.SMEM(
        shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    )


def _scan_kernel(
    meta_ref,  # [4, R] int32: row_start, row_len, row_first, row_seq
    totals_ref,  # [2] int32: used rows, real tokens
    x_ref,  # [Tp, H, P]  (Tp: T rounded up to 64 tokens, zero padded)
    b_ref,  # [Tp, G, N]
    c_ref,  # [Tp, G, N]
    cum_ref,  # [H, Tp] float32: within-row cumulative log-decay
    dt_ref,  # [H, Tp] float32: step sizes, zero for padding
    init_ref,  # [S, H, P, N] float32
    y_ref,  # [Tp, H, P] float32 (output)
    states_ref,  # [R, H, P, N] float32 (output): state after each row
    *,
    heads_per_group: int,
    state_size: int,
    padded_tokens: int,
    interpret: bool,
):
    f32, bf16 = jnp.float32, jnp.bfloat16
    N = state_size
    in_dtype = x_ref.dtype
    in_parts = 1 if in_dtype == bf16 else 2  # bfloat16 parts per input value
    head = lax.axis_index("head")
    cols = pl.ds(lax.axis_index("p") * TILE, TILE)  # this CTA's slice of P
    group = lax.div(head, heads_per_group)

    def layout(value, lay):
        return value if interpret else plgpu.layout_cast(value, lay)

    def iota(shape, dim):
        return layout(lax.broadcasted_iota(jnp.int32, shape, dim), _WGMMA)

    def tile(t):
        return pl.ds(pl.multiple_of(t * TILE, TILE), TILE)

    def body(s_land, cb_land, x_land, vecs, c_op, b_op, x_op, p_op, s_op, y_tile, barriers, transposes):
        cb_land = s_land if cb_land is None else cb_land  # float32 inputs land in the state buffer

        fetch = functools.partial(mosaic_gpu.fetch, barriers)
        store = mosaic_gpu.store

        def split(value, op, parts=2):
            """Writes value (f32) as bfloat16 parts op[0] (+ op[1]) with value ~= op[0] + op[1]."""
            hi = value.astype(bf16)
            op[0] = hi
            if parts == 2:
                op[1] = (value - hi.astype(f32)).astype(bf16)

        def mma(shape, lhs, lhs_parts, rhs, rhs_parts):
            """sum of lhs(i) @ rhs(j) over the part pairs (0, 0), (0, 1), (1, 0) that exist."""
            plgpu.commit_smem()

            def run(acc):
                for i, j in ((0, 0), (0, 1), (1, 0)):
                    if i < lhs_parts and j < rhs_parts:
                        plgpu.wgmma(acc, lhs(i), rhs(j))
                return acc[...]

            return pl.run_scoped(run, plgpu.ACC(shape, f32))

        def transposed(op):
            if not interpret:
                return lambda i: plgpu.transpose_ref(op.at[i], (1, 0))
            # The interpreter cannot read transposed wgmma operands: materialize the transpose.
            scratch = transposes[op.shape[1:]]

            def part(i):
                scratch[i] = op[i].T
                return scratch.at[i]

            return part

        def direct(op):
            return lambda i: op.at[i]

        def run_row(r, carry):
            state, pending_tile = carry  # state [64, N] f32; tile index held in `pending`, or -1
            start, length = meta_ref[0, r], meta_ref[1, r]
            end = start + length
            first_tile, last_tile = lax.div(start, TILE), lax.div(end - 1, TILE)

            def initial_state():
                fetch((init_ref.at[meta_ref[3, r], head, cols], s_land))
                return s_land[...]

            state = lax.cond(meta_ref[2, r] == 1, initial_state, lambda: state)
            split(state, s_op)

            def in_row(t, shape):
                idx = t * TILE + iota(shape, 0)  # token of each row of a [64, n] tile
                return (idx >= start) & (idx < end)

            def key_inputs(t):
                """Loads key tile t: B (masked) into b_op, its decays into vecs[1:3]; returns x as float32."""
                fetch(
                    (b_ref.at[tile(t), group], cb_land),
                    (x_ref.at[tile(t), head, cols], x_land),
                    (cum_ref.at[head, tile(t)], vecs.at[1]),
                    (dt_ref.at[head, tile(t)], vecs.at[2]),
                )
                split(jnp.where(in_row(t, (TILE, N)), cb_land[...].astype(f32), 0.0), b_op, in_parts)
                return x_land[...].astype(f32)

            # 1. Outputs, one query tile at a time.
            def query_tile(q, pending_tile):
                fetch((c_ref.at[tile(q), group], cb_land), (cum_ref.at[head, tile(q)], vecs.at[0]))
                c_q = jnp.where(in_row(q, (TILE, N)), cb_land[...].astype(f32), 0.0)
                cum_q = layout(vecs[0], _PER_ROW)
                split(c_q * jnp.exp(lax.broadcast_in_dim(cum_q, (TILE, N), [0])), c_op)
                y = mma((TILE, TILE), direct(c_op), 2, transposed(s_op), 2)  # start-state term
                split(c_q, c_op, in_parts)
                q_idx = q * TILE + iota((TILE, TILE), 0)

                def key_tile(k, y):
                    split(jnp.where(in_row(k, (TILE, TILE)), key_inputs(k), 0.0), x_op, in_parts)
                    cb = mma((TILE, TILE), direct(c_op), in_parts, transposed(b_op), in_parts)
                    cum_k = layout(vecs[1], _PER_COL)
                    dt_k = layout(vecs[2], _PER_COL)
                    k_idx = k * TILE + iota((TILE, TILE), 1)
                    # Causal pairs inside the row (exp of a cum difference with another row overflows).
                    pairs = (q_idx >= k_idx) & (k_idx >= start) & (q_idx < end)
                    log_decay = lax.broadcast_in_dim(cum_q, (TILE, TILE), [0]) - lax.broadcast_in_dim(
                        cum_k, (TILE, TILE), [1]
                    )
                    scores = cb * jnp.exp(jnp.where(pairs, log_decay, -jnp.inf))
                    split(scores * lax.broadcast_in_dim(dt_k, (TILE, TILE), [1]), p_op)
                    return y + mma((TILE, TILE), direct(p_op), 2, direct(x_op), in_parts)

                y = lax.fori_loop(first_tile, q + 1, key_tile, y)
                # Only the row's first tile can be pending (shared with the previous row); once
                # it is added, y_tile is free to stage complete tiles.
                y = lax.cond(q == pending_tile, lambda: y + y_tile[...], lambda: y)
                y_tile[...] = y
                complete = (q + 1) * TILE <= end  # later rows start at `end`

                @pl.when(complete)
                def _():
                    store(y_tile, y_ref.at[tile(q), head, cols])

                return jnp.where(complete, -1, q)  # the pending tile after this one

            pending_tile = lax.fori_loop(first_tile, last_tile + 1, query_tile, pending_tile)

            # 2. The state after the row.
            cum_last = cum_ref[head, end - 1]

            def state_tile(k, acc):
                x_k = key_inputs(k)
                weight = layout(vecs[2], _PER_ROW) * jnp.exp(cum_last - layout(vecs[1], _PER_ROW))
                x_k = x_k * lax.broadcast_in_dim(weight, (TILE, TILE), [0])
                split(jnp.where(in_row(k, (TILE, TILE)), x_k, 0.0), p_op)
                return acc + mma((TILE, N), transposed(p_op), 2, direct(b_op), in_parts)

            zero = layout(jnp.zeros((TILE, N), f32), _WGMMA)
            state = jnp.exp(cum_last) * state + lax.fori_loop(first_tile, last_tile + 1, state_tile, zero)
            s_land[...] = state
            store(s_land, states_ref.at[r, head, cols])
            return state, pending_tile

        zero_state = layout(jnp.zeros((TILE, N), f32), _WGMMA)
        _, pending_tile = lax.fori_loop(0, totals_ref[0], run_row, (zero_state, jnp.int32(-1)))

        @pl.when(pending_tile >= 0)
        def _():
            store(y_tile, y_ref.at[tile(pending_tile), head, cols])

        # Tiles after the last real token: zeros.
        y_tile[...] = layout(jnp.zeros((TILE, TILE), f32), _WGMMA)

        @pl.loop(pl.cdiv(totals_ref[1], TILE), padded_tokens // TILE)
        def _(t):
            store(y_tile, y_ref.at[tile(t), head, cols])

    pl.run_scoped(
        body,
        _smem((TILE, N), f32),  # s_land: initial and published states (and float32 C, B tiles)
        None if in_dtype == f32 else _smem((TILE, N), in_dtype),  # cb_land: C, B tiles
        _smem((TILE, TILE), in_dtype),  # x_land
        plgpu.SMEM((3, TILE), f32),  # vecs: cum of the query tile, cum and dt of the key tile
        _smem((2, TILE, N), bf16),  # c_op
        _smem((2, TILE, N), bf16),  # b_op
        _smem((2, TILE, TILE), bf16),  # x_op
        _smem((2, TILE, TILE), bf16),  # p_op: scores, or weighted x for the state
        _smem((2, TILE, N), bf16),  # s_op: the start state
        _smem((TILE, TILE), f32),  # y_tile: the pending y tile (see query_tile), or one being stored
        plgpu.Barrier(num_barriers=4),
        # transposes: scratch for the interpreter's transposed operands (see `transposed`)
        {shape: _smem((2, *shape[::-1]), bf16) for shape in {(TILE, N), (TILE, TILE)}} if interpret else None,
    )


def ragged_ssd_scan(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H] positive step sizes
    A: jax.Array,  # [H] negative
    B: jax.Array,  # [T, G, N]
    C: jax.Array,  # [T, G, N]
    init_states: jax.Array,  # [S, H, P, N]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32: absolute position of each sequence's first token
    *,
    chunk_size: int,
    interpret: bool = False,  # run on CPU with the Mosaic GPU interpreter
) -> RaggedScanOutput:
    """Runs the SSD recurrence over every sequence of a ragged batch (Pallas Mosaic GPU kernel)."""
    _layout.validate_inputs(x, dt, A, B, C, init_states, cu_seqlens, start_pos, chunk_size)
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    if head_dim % TILE:
        raise ValueError(f"head_dim must be a multiple of {TILE} for the GPU kernel, got {head_dim}")
    if state_size % 16 or state_size > MAX_STATE_SIZE:
        raise ValueError(f"state_size must be a multiple of 16 and at most {MAX_STATE_SIZE}, got {state_size}")
    if not x.dtype == B.dtype == C.dtype:
        raise ValueError(f"x, B and C must share a dtype for the GPU kernel, got {x.dtype}, {B.dtype}, {C.dtype}")

    rows = ragged.scan_rows(cu_seqlens, start_pos, num_tokens, chunk_size)
    dt_masked, cum = _layout.row_decays(dt, A, cu_seqlens, start_pos, chunk_size)
    padded = pl.cdiv(num_tokens, TILE) * TILE

    def pad(v):  # [T, ...] -> [Tp, ...], zeros after T
        return jnp.pad(v, [(0, padded - num_tokens)] + [(0, 0)] * (v.ndim - 1))

    meta = jnp.stack([rows.row_start, rows.row_len, rows.row_first, rows.row_seq])  # [4, R]
    totals = jnp.stack([rows.num_used, cu_seqlens[-1].astype(jnp.int32)])  # [2]
    f32 = jnp.float32
    kernel = plgpu.kernel(
        functools.partial(
            _scan_kernel,
            heads_per_group=num_heads // num_groups,
            state_size=state_size,
            padded_tokens=padded,
            interpret=interpret,
        ),
        out_type=(
            jax.ShapeDtypeStruct((padded, num_heads, head_dim), f32),
            jax.ShapeDtypeStruct((rows.chunk_seq.shape[0], num_heads, head_dim, state_size), f32),
        ),
        grid=(num_heads, head_dim // TILE),
        grid_names=("head", "p"),
        interpret=mosaic_gpu.interpreter() if interpret else False,
    )
    y, chunk_states = kernel(
        meta, totals, pad(x), pad(B), pad(C), pad(cum).T, pad(dt_masked).T, init_states.astype(f32)
    )
    return RaggedScanOutput(
        y=y[:num_tokens],
        final_states=ragged.final_states(rows, chunk_states, init_states),
        chunk_states=chunk_states,
        chunk_seq=rows.chunk_seq,
        chunk_end=rows.chunk_end,
    )
