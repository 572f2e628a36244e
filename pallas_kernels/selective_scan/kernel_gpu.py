"""Pallas Mosaic GPU kernel for the ragged Mamba-1 selective scan; drop-in for
`reference.ragged_selective_scan`.

Backend: Mosaic GPU (`jax.experimental.pallas.mosaic_gpu`), as the SSD kernel (see
`pallas_kernels/ssd/kernel_gpu.py` for how it lowers and is interpreted on a CPU-only
machine). In interpret mode the kernel drops its layout annotations, which the interpreter
does not implement; the arithmetic is the same.

Semantics are the reference's: rows of the absolute chunk grid (`ragged.scan_rows`), each
sequence restarting from its initial state, outputs y [T, d], final_states [S, d, N] and
the state after every row, with the same row layout (`chunk_seq`, `chunk_end`).

Kernel. One CTA (one warpgroup) per 128 channels: it walks the flat token axis in order in
64-token tiles (copied to shared memory; T zero-padded to a multiple of 64), carrying its
[128, N] slice of the state in registers (each channel's N entries in one thread's
registers, the WGMMA layout). Per token, from per-token metadata XLA computes:
    h <- init[seq]                                  at a sequence's first token
    h <- exp(A * dt_t) * h + (dt_t x_t) B_t^T        [128, 1] x [1, N] broadcasts
    y_t = h C_t                                      a sum over the N entries
    chunk_states[r] <- h                             at the last token of row r
Padding tokens (dt = 0, x = 0) neither decay nor write, and their y is dropped.

Numerics: float32 throughout, as the reference. Requires d a multiple of 128 and N a
multiple of 8. Copies are synchronous and the recurrence is one token at a time: the kernel
favours simplicity over overlap. Checked and timed on an H200 by `scripts/device_check.py`
(BENCHMARKS.md).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mosaic_gpu, ragged
from pallas_kernels.selective_scan.reference import SelectiveScanOutput, validate_inputs

TILE = 64  # tokens per shared-memory tile
CHANNELS = 128  # channels per CTA: one per thread of the warpgroup

_WGMMA = plgpu.Layout.WGMMA
_PER_CHANNEL = _WGMMA.reduce(1)  # [128] vector indexed like the rows of a WGMMA [128, N] array
_PER_STATE = _WGMMA.reduce(0)  # [N] vector indexed like its columns


def _scan_kernel(
    token_meta_ref,  # [3, Tp] int32: the token's sequence, 1 at a sequence's first token, its row if it ends one (else -1)
    u_ref,  # [Tp, d] float32: dt * x, zero for padding
    dt_ref,  # [Tp, d] float32: zero for padding
    b_ref,  # [Tp, N] float32
    c_ref,  # [Tp, N] float32
    a_ref,  # [d, N] float32
    init_ref,  # [S, d, N] float32
    y_ref,  # [Tp, d] float32 (output)
    states_ref,  # [R, d, N] float32 (output): state after each row
    *,
    state_size: int,
    padded_tokens: int,
    interpret: bool,
):
    f32 = jnp.float32
    N = state_size
    cols = pl.ds(lax.axis_index("c") * CHANNELS, CHANNELS)

    def layout(value, lay):
        return value if interpret else plgpu.layout_cast(value, lay)

    def body(u_land, dt_land, b_land, c_land, y_land, s_land, meta_land, barriers):
        fetch = functools.partial(mosaic_gpu.fetch, barriers)
        store = mosaic_gpu.store

        fetch((a_ref.at[cols], s_land))
        a = layout(s_land[...], _WGMMA)  # [128, N]

        def tile(i, h):
            span = pl.ds(pl.multiple_of(i * TILE, TILE), TILE)
            fetch(
                (u_ref.at[span, cols], u_land),
                (dt_ref.at[span, cols], dt_land),
                (b_ref.at[span], b_land),
                (c_ref.at[span], c_land),
                (token_meta_ref.at[:, span], meta_land),
            )

            def token(j, h):
                def initial():
                    fetch((init_ref.at[meta_land[0, j], cols], s_land))
                    return layout(s_land[...], _WGMMA)

                h = lax.cond(meta_land[1, j] == 1, initial, lambda: h)
                u = lax.broadcast_in_dim(layout(u_land[j], _PER_CHANNEL), (CHANNELS, N), [0])
                dt = lax.broadcast_in_dim(layout(dt_land[j], _PER_CHANNEL), (CHANNELS, N), [0])
                B = lax.broadcast_in_dim(layout(b_land[j], _PER_STATE), (CHANNELS, N), [1])
                C = lax.broadcast_in_dim(layout(c_land[j], _PER_STATE), (CHANNELS, N), [1])
                h = jnp.exp(a * dt) * h + u * B
                y_land[j] = jnp.sum(h * C, axis=1)
                row = meta_land[2, j]

                @pl.when(row >= 0)
                def _():
                    s_land[...] = h
                    store(s_land, states_ref.at[row, cols])

                return h

            h = lax.fori_loop(0, TILE, token, h)
            store(y_land, y_ref.at[span, cols])
            return h

        zero = layout(jnp.zeros((CHANNELS, N), f32), _WGMMA)
        lax.fori_loop(0, padded_tokens // TILE, tile, zero)

    pl.run_scoped(
        body,
        plgpu.SMEM((TILE, CHANNELS), f32),  # u_land
        plgpu.SMEM((TILE, CHANNELS), f32),  # dt_land
        plgpu.SMEM((TILE, N), f32),  # b_land
        plgpu.SMEM((TILE, N), f32),  # c_land
        plgpu.SMEM((TILE, CHANNELS), f32),  # y_land
        plgpu.SMEM((CHANNELS, N), f32),  # s_land: A, initial and published states
        plgpu.SMEM((3, TILE), jnp.int32),  # meta_land
        plgpu.Barrier(num_barriers=5),
    )


def ragged_selective_scan(
    x: jax.Array,  # [T, d]
    dt: jax.Array,  # [T, d] positive step sizes
    A: jax.Array,  # [d, N] negative
    B: jax.Array,  # [T, N]
    C: jax.Array,  # [T, N]
    init_states: jax.Array,  # [S, d, N]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32
    *,
    chunk_size: int,
    interpret: bool = False,  # run on CPU with the Mosaic GPU interpreter
) -> SelectiveScanOutput:
    """Runs the selective scan over every sequence of a ragged batch (Pallas Mosaic GPU kernel)."""
    validate_inputs(x, dt, A, B, C, init_states)
    num_tokens, channels = x.shape
    state_size = A.shape[1]
    if channels % CHANNELS:
        raise ValueError(f"the channels (d) must be a multiple of {CHANNELS} for the GPU kernel, got {channels}")
    if state_size % 8:
        raise ValueError(f"state_size must be a multiple of 8 for the GPU kernel, got {state_size}")

    rows = ragged.scan_rows(cu_seqlens, start_pos, num_tokens, chunk_size)
    seq, _, valid = ragged.token_segments(cu_seqlens, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    first = valid & (t == cu_seqlens[seq])
    last_token = jnp.where(rows.row_len > 0, rows.row_start + rows.row_len - 1, num_tokens)  # unused rows: dropped
    row_of_end = (
        jnp.full((num_tokens,), -1, jnp.int32)
        .at[last_token]
        .set(jnp.arange(rows.chunk_seq.shape[0], dtype=jnp.int32), mode="drop")
    )
    padded = pl.cdiv(num_tokens, TILE) * TILE

    f32 = jnp.float32

    def pad(v):  # [T, ...] -> [Tp, ...], zeros after T (and for padding tokens)
        v = jnp.where(valid.reshape(-1, *[1] * (v.ndim - 1)), v, 0)
        return jnp.pad(v, [(0, padded - num_tokens)] + [(0, 0)] * (v.ndim - 1))

    meta = jnp.stack([seq, first.astype(jnp.int32), row_of_end])  # [3, T]; padding ends no row
    meta = jnp.pad(meta, ((0, 0), (0, padded - num_tokens))).at[2, num_tokens:].set(-1)  # [3, Tp]
    dt32 = dt.astype(f32)
    kernel = plgpu.kernel(
        functools.partial(_scan_kernel, state_size=state_size, padded_tokens=padded, interpret=interpret),
        out_type=(
            jax.ShapeDtypeStruct((padded, channels), f32),
            jax.ShapeDtypeStruct((rows.chunk_seq.shape[0], channels, state_size), f32),
        ),
        grid=(channels // CHANNELS,),
        grid_names=("c",),
        interpret=mosaic_gpu.interpreter() if interpret else False,
    )
    y, chunk_states = kernel(
        meta,
        pad(dt32 * x.astype(f32)),
        pad(dt32),
        pad(B.astype(f32)),
        pad(C.astype(f32)),
        A.astype(f32),
        init_states.astype(f32),
    )
    return SelectiveScanOutput(
        y=jnp.where(valid[:, None], y[:num_tokens], 0.0),
        final_states=ragged.final_states(rows, chunk_states, init_states),
        chunk_states=chunk_states,
        chunk_seq=rows.chunk_seq,
        chunk_end=rows.chunk_end,
    )
