"""Pallas TPU (Mosaic) kernel for the ragged Mamba-1 selective scan; drop-in for
`reference.ragged_selective_scan`.

Semantics are the reference's (see its docstring): rows of the absolute chunk grid
(`ragged.scan_rows`), each sequence restarting from its initial state, outputs y [T, d],
final_states [S, d, N] and the state after every row with the same row layout
(`chunk_seq`, `chunk_end`), so callers may use either implementation.

Layout. XLA places each row's tokens in a [R, chunk, ...] grid, a token's values on a
leading axis of their own (so the kernel reads token t with a dynamic index on an untiled
axis): x * dt and dt as [R, chunk, 1, d], B and C as columns [R, chunk, N, 1]; padding and
empty cells are zero (dt = 0: they neither decay nor write). The state is held transposed,
h^T [N, d], so that the channels lie on lanes; A comes as A^T [N, d], the initial and
row-end states as [.., N, d].

Kernel. Grid (channel blocks: "parallel", rows: "arbitrary"). The state of the block's
channels lives in VMEM scratch across rows; at a sequence's first row it is reset from
init_states (a block whose index the row's sequence, a scalar-prefetched array, selects).
The row's tokens (its cells from its first column on) are walked in order, one [N, db]
update each, all on the VPU:
    h^T <- exp(A^T * dt_t) * h^T + B_t (dt_t x_t)       [N, 1] * [1, db]
    y_t  = sum_n C_t[n] h^T[n]                           [1, db]
Rows of padding (unused rows of the static grid) are skipped.

Numerics: everything is float32 as in the reference.

Block choices: db = the largest of 256 and 128 dividing d (d itself otherwise). A token's
[1, db] slice fills one sublane of eight and its [N, 1] column one lane of 128, so the
blocks are padded 8x and 128x: per step at chunk 64, db = 256, N = 16, the x * dt, dt and y
blocks take 3 x 2 x 512 KiB and B and C 2 x 2 x 512 KiB: 5 MiB of VMEM, under the 16 MiB
scoped default.

Verification: the tests run the kernel in the Mosaic TPU interpreter against the reference and
lower it with jax.export for platforms=["tpu"]; no test here compiles it on a TPU.
"""

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import ragged
from pallas_kernels.selective_scan.reference import SelectiveScanOutput, validate_inputs


def channels_per_block(channels: int) -> int:
    return next((d for d in (256, 128) if channels % d == 0), channels)


def _row_kernel(
    row_seq_ref,  # [R] int32 (scalar prefetch): the row's sequence, clipped into range
    row_first_ref,  # [R] int32: 1 where the row restarts from its sequence's initial state
    row_col_ref,  # [R] int32: the column of the row's first token
    row_len_ref,  # [R] int32: the row's tokens; 0 for unused rows
    u_ref,  # [1, cs, 1, db] dt * x
    dt_ref,  # [1, cs, 1, db]
    b_ref,  # [1, cs, N, 1]
    c_ref,  # [1, cs, N, 1]
    a_ref,  # [N, db] A^T
    init_ref,  # [1, N, db]: the row's sequence's initial state, transposed
    y_ref,  # [1, cs, 1, db] float32
    end_ref,  # [1, N, db] float32: the state after the row, transposed
    state_ref,  # scratch [N, db] float32
):
    r = pl.program_id(1)

    @pl.when(row_first_ref[r] == 1)
    def _():
        state_ref[...] = init_ref[0].astype(jnp.float32)

    @pl.when(row_len_ref[r] > 0)
    def _():
        a = a_ref[...]

        def token(t, h):
            h = jnp.exp(a * dt_ref[0, t]) * h + b_ref[0, t] * u_ref[0, t]
            y_ref[0, t] = jnp.sum(c_ref[0, t] * h, axis=0, keepdims=True)
            return h

        first = row_col_ref[r]
        end = lax.fori_loop(first, first + row_len_ref[r], token, state_ref[...])
        state_ref[...] = end
        end_ref[0] = end


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
    interpret: bool = False,  # run on CPU with the Mosaic TPU interpreter
) -> SelectiveScanOutput:
    """Runs the selective scan over every sequence of a ragged batch (Pallas TPU kernel)."""
    validate_inputs(x, dt, A, B, C, init_states)
    num_tokens, channels = x.shape
    state = A.shape[1]
    cs = chunk_size
    cells = ragged.row_grid(cu_seqlens, start_pos, num_tokens, cs)
    rows = cells.rows
    num_rows = rows.chunk_seq.shape[0]

    f32 = jnp.float32
    place = lambda t: jnp.swapaxes(cells.place(t.astype(f32)), 1, 2)  # noqa: E731  [T, k] -> [R, cs, k]
    dt_g = place(dt)[:, :, None, :]  # [R, cs, 1, d]
    u_g = place(dt.astype(f32) * x.astype(f32))[:, :, None, :]
    b_g, c_g = place(B)[..., None], place(C)[..., None]  # [R, cs, N, 1]
    init_t = jnp.swapaxes(init_states.astype(f32), 1, 2)  # [S, N, d]
    row_col = (rows.chunk_end - rows.row_len) % cs  # [R]: the first token's column

    db = channels_per_block(channels)
    channels_block = pl.BlockSpec((1, cs, 1, db), lambda c, r, *_: (r, 0, 0, c))
    column = pl.BlockSpec((1, cs, state, 1), lambda c, r, *_: (r, 0, 0, 0))
    state_block = pl.BlockSpec((1, state, db), lambda c, r, *_: (r, 0, c))
    y_grid, ends = pl.pallas_call(
        _row_kernel,
        out_shape=[
            jax.ShapeDtypeStruct((num_rows, cs, 1, channels), f32),
            jax.ShapeDtypeStruct((num_rows, state, channels), f32),
        ],
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(channels // db, num_rows),
            in_specs=[
                channels_block, channels_block, column, column,
                pl.BlockSpec((state, db), lambda c, r, *_: (0, c)),
                pl.BlockSpec((1, state, db), lambda c, r, seq_ref, *_: (seq_ref[r], 0, c)),
            ],
            out_specs=[channels_block, state_block],
            scratch_shapes=[pltpu.VMEM((state, db), f32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(rows.row_seq, rows.row_first, row_col, rows.row_len, u_g, dt_g, b_g, c_g, A.astype(f32).T, init_t)  # fmt: skip
    chunk_states = jnp.swapaxes(ends, 1, 2)  # [R, d, N]
    return SelectiveScanOutput(
        y=cells.take(jnp.swapaxes(y_grid[:, :, 0], 1, 2)),  # [T, d]
        final_states=ragged.final_states(rows, chunk_states, init_states),
        chunk_states=chunk_states,
        chunk_seq=rows.chunk_seq,
        chunk_end=rows.chunk_end,
    )
