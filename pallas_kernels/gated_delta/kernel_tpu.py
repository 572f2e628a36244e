"""Pallas TPU (Mosaic) kernel for the ragged gated delta rule; drop-in for `reference.ragged_gated_delta`.

Semantics are the reference's (see its docstring): rows of the absolute chunk grid
(`ragged.scan_rows`), each sequence restarting from its initial state, outputs o [T, H_v, d_v],
final_states [S, H_v, d_k, d_v] and the state after every row with the same row layout
(`chunk_seq`, `chunk_end`), so callers may use either implementation.

Layout. XLA places each row's tokens in a [R, H_v, chunk, d] grid (value heads first, so a
block is one row of `hb` heads with whole (chunk, d) tiles), keys and queries repeated over
their value heads, queries scaled, and the within-row cumulative log-decay computed; padding
and empty cells are zero (g = beta = 0: they neither decay nor write). The learning rate and
the decay come as columns [chunk, 1] (to scale rows) and the decay also as a row [1, chunk].

Kernel. Grid (head blocks: "parallel", rows: "arbitrary"). The state of each head lives in
VMEM scratch across rows; at a sequence's first row it is reset from init_states (a block
whose index the row's sequence, a scalar-prefetched array, selects). For each head of the
block, with D_ij = exp(G_i - G_j) (i >= j):
    M  = I + strictly_lower(beta_i k_i . k_j D_ij)
    [U | W] = M^-1 [beta v | beta exp(G) k]      forward substitution, one row per step
    V' = U - W S;  o = (exp(G) q) S + lower(q . k D) V';  S <- exp(G_L) S + (exp(G_L - G) k)^T V'
The substitution is `chunk` steps of a masked row extraction and a [1, chunk] x [chunk, d_v + d_k]
product; the rest are MXU products. Rows of padding (unused rows of the static grid) are skipped.

Numerics: everything is float32 as in the reference, products at Precision.HIGHEST.

Block choices: hb = the largest divisor of H_v that is at most 8 and a multiple of 8 or H_v
itself (the scalar-per-head columns put heads on sublanes). Per-step VMEM at chunk 64, d_k = d_v
= 128, hb = 8: q, k, v blocks 3 x 2 x 256 KiB, state 512 KiB, outputs 2 x 2 x 256 KiB, and
the [64, 64] and [64, 256] temporaries of one head: under 4 MiB.

Verification: the tests run the kernel in the Mosaic TPU interpreter against the reference and
lower it with jax.export for platforms=["tpu"]; no test here compiles it on a TPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import ragged
from pallas_kernels.gated_delta.reference import GatedDeltaOutput, validate_inputs, value_heads

MAX_HEADS_PER_BLOCK = 8
_TRANS_B = (((1,), (1,)), ((), ()))  # a @ b^T
_TRANS_A = (((0,), (0,)), ((), ()))  # a^T @ b


def heads_per_block(num_heads: int) -> int:
    fits = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and (d % 8 == 0 or d == num_heads)]
    small = [d for d in fits if d <= MAX_HEADS_PER_BLOCK]
    return max(small) if small else min(fits)


def _dot(a: jax.Array, b: jax.Array, dims=(((1,), (0,)), ((), ()))) -> jax.Array:
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _forward_substitute(strict: jax.Array, rhs: jax.Array) -> jax.Array:
    """X with (I + strict) X = rhs: strict [L, L] strictly lower triangular, rhs [L, d]; one row
    per step, each a masked row extraction and a [1, L] x [L, d] product."""
    size = strict.shape[0]
    matrix_rows = lax.broadcasted_iota(jnp.int32, strict.shape, 0)
    rhs_rows = lax.broadcasted_iota(jnp.int32, rhs.shape, 0)

    def substitute(i, x):  # rows < i of x are solved, the others zero
        coeff = jnp.sum(jnp.where(matrix_rows == i, strict, 0.0), axis=0, keepdims=True)  # [1, L]
        row = jnp.sum(jnp.where(rhs_rows == i, rhs, 0.0), axis=0, keepdims=True) - _dot(coeff, x)
        return jnp.where(rhs_rows == i, row, x)

    return lax.fori_loop(0, size, substitute, jnp.zeros_like(rhs))


def _row_kernel(
    row_seq_ref,  # [R] int32 (scalar prefetch): the row's sequence, clipped into range
    row_first_ref,  # [R] int32: 1 where the row restarts from its sequence's initial state
    row_used_ref,  # [R] int32: 1 for rows with tokens
    q_ref,  # [1, hb, cs, d_k] scaled queries
    k_ref,  # [1, hb, cs, d_k]
    v_ref,  # [1, hb, cs, d_v]
    beta_ref,  # [1, hb, cs, 1]
    cum_col_ref,  # [1, hb, cs, 1] G, the within-row cumulative log-decay
    cum_row_ref,  # [1, hb, 1, cs]
    init_ref,  # [1, hb, d_k, d_v]: the row's sequence's initial state
    o_ref,  # [1, hb, cs, d_v] float32
    end_ref,  # [1, hb, d_k, d_v] float32: the state after the row
    state_ref,  # scratch [hb, d_k, d_v] float32
    *,
    heads: int,
    chunk: int,
):
    r = pl.program_id(1)

    @pl.when(row_first_ref[r] == 1)
    def _():
        state_ref[...] = init_ref[0].astype(jnp.float32)

    @pl.when(row_used_ref[r] == 1)
    def _():
        ii = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        jj = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        for h in range(heads):
            q, k, v = q_ref[0, h], k_ref[0, h], v_ref[0, h]  # [cs, d]
            beta, cum_c, cum_r = beta_ref[0, h], cum_col_ref[0, h], cum_row_ref[0, h]  # [cs, 1], [cs, 1], [1, cs]
            decay = jnp.where(ii >= jj, jnp.exp(jnp.where(ii >= jj, cum_c - cum_r, 0.0)), 0.0)  # [cs, cs]
            strict = jnp.where(ii > jj, _dot(k * beta, k, _TRANS_B) * decay, 0.0)
            rhs = jnp.concatenate([v * beta, k * (beta * jnp.exp(cum_c))], axis=1)  # [cs, d_v + d_k]
            solved = _forward_substitute(strict, rhs)
            value_dim = v.shape[1]
            u, w = solved[:, :value_dim], solved[:, value_dim:]
            start = state_ref[h]  # [d_k, d_v]
            corrections = u - _dot(w, start)
            intra = _dot(q, k, _TRANS_B) * decay
            o_ref[0, h] = _dot(q * jnp.exp(cum_c), start) + _dot(intra, corrections)
            last = cum_r[:, chunk - 1 :]  # [1, 1]
            end = jnp.exp(last) * start + _dot(k * jnp.exp(last - cum_c), corrections, _TRANS_A)
            state_ref[h] = end
            end_ref[0, h] = end


def ragged_gated_delta(
    q: jax.Array,  # [T, H_k, d_k] L2-normalised
    k: jax.Array,  # [T, H_k, d_k] L2-normalised
    v: jax.Array,  # [T, H_v, d_v]
    g: jax.Array,  # [T, H_v] log-decay (<= 0)
    beta: jax.Array,  # [T, H_v]
    init_states: jax.Array,  # [S, H_v, d_k, d_v]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32
    *,
    chunk_size: int,
    scale: float,
    interpret: bool = False,  # run on CPU with the Mosaic TPU interpreter
) -> GatedDeltaOutput:
    """Runs the gated delta rule over every sequence of a ragged batch (Pallas TPU kernel)."""
    validate_inputs(q, k, v, g, beta, init_states)
    num_tokens, _, key_dim = k.shape
    num_heads, value_dim = v.shape[1:]
    cs = chunk_size
    cells = ragged.row_grid(cu_seqlens, start_pos, num_tokens, cs)
    rows = cells.rows
    num_rows = rows.chunk_seq.shape[0]

    f32 = jnp.float32
    qg = cells.place(value_heads(q.astype(f32) * scale, num_heads))  # [R, H, cs, d_k]
    kg = cells.place(value_heads(k.astype(f32), num_heads))
    vg = cells.place(v.astype(f32))  # [R, H, cs, d_v]
    cum = jnp.cumsum(cells.place(g.astype(f32)), axis=-1)  # [R, H, cs]
    beta_g = cells.place(beta.astype(f32))

    hb = heads_per_block(num_heads)
    block = lambda *tail: pl.BlockSpec((1, hb, *tail), lambda h, r, *_: (r, h, *[0] * len(tail)))  # noqa: E731
    init_spec = pl.BlockSpec((1, hb, key_dim, value_dim), lambda h, r, seq_ref, *_: (seq_ref[r], h, 0, 0))
    o_grid, chunk_states = pl.pallas_call(
        functools.partial(_row_kernel, heads=hb, chunk=cs),
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, num_heads, cs, value_dim), f32),
            jax.ShapeDtypeStruct((num_rows, num_heads, key_dim, value_dim), f32),
        ],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_heads // hb, num_rows),
            in_specs=[block(cs, key_dim), block(cs, key_dim), block(cs, value_dim), block(cs, 1), block(cs, 1),
                      block(1, cs), init_spec],
            out_specs=[block(cs, value_dim), block(key_dim, value_dim)],
            scratch_shapes=[pltpu.VMEM((hb, key_dim, value_dim), f32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        rows.row_seq, rows.row_first, (rows.row_len > 0).astype(jnp.int32),
        qg, kg, vg, beta_g[..., None], cum[..., None], cum[:, :, None, :], init_states.astype(f32),
    )  # fmt: skip
    return GatedDeltaOutput(
        o=cells.take(o_grid),  # [T, H, d_v]
        final_states=ragged.final_states(rows, chunk_states, init_states),
        chunk_states=chunk_states,
        chunk_seq=rows.chunk_seq,
        chunk_end=rows.chunk_end,
    )
