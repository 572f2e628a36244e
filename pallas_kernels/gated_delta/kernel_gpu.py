"""Pallas Mosaic GPU kernel for the ragged gated delta rule; drop-in for `reference.ragged_gated_delta`.

Backend: Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`), as the SSD and selective-scan
kernels (see `pallas_kernels/ssd/kernel_gpu.py` for how it lowers and is interpreted on a
CPU-only machine). In interpret mode the kernel drops its layout annotations, which the
interpreter does not implement; the arithmetic is the same.

Semantics are the reference's: rows of the absolute chunk grid (`ragged.scan_rows`), each
sequence starting from its initial state, outputs o [T, H_v, d_v] (zero for padding),
final_states [S, H_v, d_k, d_v] and the state after every used row, with the same row layout
(`chunk_seq`, `chunk_end`), so callers may use either implementation.

Kernel. The delta rule never mixes value columns: column j of the state S [d_k, d_v] evolves
from v_t[j] alone. So one CTA (one warpgroup) takes one (sequence, value head, 64 value
columns): grid (S, H_v, d_v / 64), the CTAs of empty sequences doing nothing. It carries its
slice of the state transposed, S^T [64, d_k] float32, in registers in the WGMMA layout (each
row's d_k entries on the four lanes of one warp, so sums over d_k stay within a warp), and
walks the 64-token tiles of the flat token axis that its sequence touches (aligned TMA copies
to shared memory), one of its tokens at a time. With a = exp(g_t), b = beta_t and the state
before the token:
    Sk = S^T k_t,  Sq = S^T q_t                  [64] sums over d_k, both from the old state
    delta = b (v_t - a Sk)                       [64]
    o_t = a Sq + (k_t . q_t) delta               (= the new state's S^T q_t)
    S^T <- a S^T + delta k_t^T
    chunk_states[r] <- S                         at the last token of row r
so the token's two reductions do not wait for its update. XLA computes exp(g), q scaled and
k . q per token beforehand, and transposes the initial states in and the row states out
(the kernel holds S^T). Outputs are stored a whole tile at a time into a buffer where
sequence s's token t sits at row t + 64 s: a tile shared by two sequences of the flat axis
is two tiles there, so no CTA overwrites another's tokens, and XLA gathers o back. Tiles
stay aligned to the flat axis: on an H200, TMA loads of a tile starting at a sequence's
first token, mid-tile, stopped the kernel with an illegal instruction.

Numerics: float32 throughout, as the reference (bfloat16 inputs are upcast first).

Block choices (Qwen3.5 / Qwen3-Next: 16 key heads, 32 value heads, d_k = d_v = 128): grid
S x 32 x 2 CTAs. The state takes d_k / 2 = 64 registers per thread. Shared memory for
d_k = 128: q and k tiles 2 x 32 KiB, the state (initial, and published at row ends; tiled and
swizzled) 32 KiB, v and o tiles 2 x 16 KiB, per-token scalars 1 KiB: about 129 KiB, so one
CTA per SM. Shared memory would take d_k up to 192; registers keep it at 128. Requires d_k a
multiple of 8 (the WGMMA layout's columns) and at most 128, and d_v a multiple of 64. The
recurrence is one token at a time and the copies are synchronous: the kernel favours
simplicity over tensor cores and overlap (the chunked form, as in the TPU kernel, would put
the work on wgmma).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu, ragged
from pallas_kernels.gated_delta.reference import GatedDeltaOutput, validate_inputs

TILE = 64  # tokens per shared-memory tile
SLICE = 64  # value columns per CTA: the rows of a WGMMA-layout array
MAX_KEY_DIM = 128  # registers and shared memory (see the module docstring)

_WGMMA = plgpu.Layout.WGMMA
_PER_ROW = _WGMMA.reduce(1)  # [64] vector indexed like the rows of a WGMMA [64, d_k] array
_PER_COL = _WGMMA.reduce(0)  # [d_k] vector indexed like its columns


def _swizzled_smem(shape: tuple[int, int]) -> plgpu.SMEM:
    """float32 shared memory tiled and swizzled, which whole WGMMA-layout arrays are moved
    through without bank conflicts (an untiled [64, 128] one finds no conflict-free plan)."""
    swizzle = next(s for s in (128, 64, 32) if shape[-1] * 4 % s == 0)
    return plgpu.SMEM(
        shape, jnp.float32, transforms=(plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle))
    )


def _scan_kernel(
    seq_ref,  # [2, S] int32: each sequence's first flat token, and its length
    row_end_ref,  # [Tp] int32: the row a token is the last of, else -1
    q_ref,  # [Tp, H_k, d_k] float32, scaled  (Tp: T rounded up to whole tiles, zero padded)
    k_ref,  # [Tp, H_k, d_k] float32
    v_ref,  # [Tp, H_v, d_v] float32
    scalars_ref,  # [H_v, 3, Tp] float32: exp(g), beta, k . q
    init_ref,  # [S, H_v, d_v, d_k] float32: initial states, transposed
    o_ref,  # [Tp + 64 S, H_v, d_v] float32 (output): token t of sequence s at row t + 64 s
    states_ref,  # [R, H_v, d_v, d_k] float32 (output): state after each used row, transposed
    *,
    heads_per_key: int,
    key_dim: int,
    interpret: bool,
):
    seq, head = lax.axis_index("seq"), lax.axis_index("head")
    key_head = lax.div(head, heads_per_key)
    cols = pl.ds(lax.axis_index("v") * SLICE, SLICE)  # this CTA's value columns
    start, length = seq_ref[0, seq], seq_ref[1, seq]

    def layout(value, lay):
        return value if interpret else plgpu.layout_cast(value, lay)

    def body(q_land, k_land, v_land, o_land, s_land, scalars_land, row_end_land, barriers):
        fetch = functools.partial(mosaic_gpu.fetch, barriers)

        def tile(i, state):
            first = pl.multiple_of(i * TILE, TILE)
            span = pl.ds(first, TILE)
            fetch(
                (q_ref.at[span, key_head], q_land), (k_ref.at[span, key_head], k_land),
                (v_ref.at[span, head, cols], v_land), (scalars_ref.at[head, :, span], scalars_land),
                (row_end_ref.at[span], row_end_land),
            )  # fmt: skip

            def token(j, state):
                k = lax.broadcast_in_dim(layout(k_land[j], _PER_COL), (SLICE, key_dim), [1])
                q = lax.broadcast_in_dim(layout(q_land[j], _PER_COL), (SLICE, key_dim), [1])
                decay, beta, kq = scalars_land[0, j], scalars_land[1, j], scalars_land[2, j]
                sk = jnp.sum(state * k, axis=1)
                sq = jnp.sum(state * q, axis=1)
                delta = beta * (layout(v_land[j], _PER_ROW) - decay * sk)
                o_land[j] = decay * sq + kq * delta
                state = decay * state + lax.broadcast_in_dim(delta, (SLICE, key_dim), [0]) * k
                row = row_end_land[j]

                @pl.when(row >= 0)
                def _():
                    s_land[...] = state
                    mosaic_gpu.store(s_land, states_ref.at[row, head, cols])

                return state

            # This sequence's tokens in the tile; the other rows of o_land are not stored as ours.
            lo, hi = jnp.maximum(start - first, 0), jnp.minimum(start + length - first, TILE)
            state = lax.fori_loop(lo, hi, token, state)
            mosaic_gpu.store(o_land, o_ref.at[pl.ds(pl.multiple_of(first + seq * TILE, TILE), TILE), head, cols])
            return state

        @pl.when(length > 0)
        def _():
            fetch((init_ref.at[seq, head, cols], s_land))
            tiles = (lax.div(start, TILE), lax.div(start + length - 1, TILE) + 1)
            lax.fori_loop(*tiles, tile, layout(s_land[...], _WGMMA))

    pl.run_scoped(
        body,
        plgpu.SMEM((TILE, key_dim), jnp.float32),  # q_land
        plgpu.SMEM((TILE, key_dim), jnp.float32),  # k_land
        plgpu.SMEM((TILE, SLICE), jnp.float32),  # v_land
        plgpu.SMEM((TILE, SLICE), jnp.float32),  # o_land
        _swizzled_smem((SLICE, key_dim)),  # s_land: the initial state, then published ones
        plgpu.SMEM((3, TILE), jnp.float32),  # scalars_land
        plgpu.SMEM((TILE,), jnp.int32),  # row_end_land
        plgpu.Barrier(num_barriers=5),
    )


def ragged_gated_delta(
    q: jax.Array,  # [T, H_k, d_k] L2-normalised
    k: jax.Array,  # [T, H_k, d_k] L2-normalised
    v: jax.Array,  # [T, H_v, d_v]
    g: jax.Array,  # [T, H_v] log-decay (<= 0)
    beta: jax.Array,  # [T, H_v]
    init_states: jax.Array,  # [S, H_v, d_k, d_v]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32: absolute position of each sequence's first token
    *,
    chunk_size: int,
    scale: float,
    interpret: bool = False,  # run on CPU with the Mosaic GPU interpreter
) -> GatedDeltaOutput:
    """Runs the gated delta rule over every sequence of a ragged batch (Pallas Mosaic GPU kernel)."""
    validate_inputs(q, k, v, g, beta, init_states)
    num_tokens, num_key_heads, key_dim = k.shape
    num_heads, value_dim = v.shape[1:]
    num_seqs = init_states.shape[0]
    if value_dim % SLICE:
        raise ValueError(f"value_dim (d_v) must be a multiple of {SLICE} for the GPU kernel, got {value_dim}")
    if key_dim % 8 or key_dim > MAX_KEY_DIM:
        raise ValueError(
            f"key_dim (d_k) must be a multiple of 8 and at most {MAX_KEY_DIM} for the GPU kernel, got {key_dim}"
        )

    rows = ragged.scan_rows(cu_seqlens, start_pos, num_tokens, chunk_size)
    num_rows = rows.chunk_seq.shape[0]
    padded = pl.cdiv(num_tokens, TILE) * TILE
    cu = cu_seqlens.astype(jnp.int32)
    last_token = jnp.where(rows.row_len > 0, rows.row_start + rows.row_len - 1, padded)  # unused rows: dropped
    row_end = jnp.full((padded,), -1, jnp.int32).at[last_token].set(jnp.arange(num_rows, dtype=jnp.int32), mode="drop")

    f32 = jnp.float32

    def pad(x):  # [T, ...] -> [Tp, ...], zeros after T
        return jnp.pad(x, [(0, padded - num_tokens)] + [(0, 0)] * (x.ndim - 1))

    q32, k32 = q.astype(f32) * scale, k.astype(f32)
    kq = jnp.repeat(jnp.sum(q32 * k32, axis=-1), num_heads // num_key_heads, axis=1)  # [T, H_v]
    scalars = pad(jnp.stack([jnp.exp(g.astype(f32)), beta.astype(f32), kq], axis=1)).transpose(2, 1, 0)  # [H_v, 3, Tp]
    kernel = plgpu.kernel(
        functools.partial(_scan_kernel, heads_per_key=num_heads // num_key_heads, key_dim=key_dim, interpret=interpret),
        out_type=(
            jax.ShapeDtypeStruct((padded + num_seqs * TILE, num_heads, value_dim), f32),
            jax.ShapeDtypeStruct((num_rows, num_heads, value_dim, key_dim), f32),
        ),
        grid=(num_seqs, num_heads, value_dim // SLICE),
        grid_names=("seq", "head", "v"),
        interpret=mosaic_gpu.interpreter() if interpret else False,
    )
    o_shifted, states_t = kernel(
        jnp.stack([cu[:-1], cu[1:] - cu[:-1]]), row_end, pad(q32), pad(k32), pad(v.astype(f32)), scalars,
        init_states.astype(f32).swapaxes(-1, -2),
    )  # fmt: skip
    chunk_states = states_t.swapaxes(-1, -2)  # [R, H_v, d_k, d_v]
    token_seq, _, valid = ragged.token_segments(cu, num_tokens)
    o = o_shifted[jnp.arange(num_tokens) + token_seq * TILE]  # [T, H_v, d_v]
    return GatedDeltaOutput(
        o=jnp.where(valid[:, None, None], o, 0.0),
        final_states=ragged.final_states(rows, chunk_states, init_states),
        chunk_states=chunk_states,
        chunk_seq=rows.chunk_seq,
        chunk_end=rows.chunk_end,
    )
