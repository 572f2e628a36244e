"""Pure-jnp reference for the Mamba-1 selective scan over a ragged batch.

The recurrence, per channel d (state h [N]), for token t with input x_t[d], step size
dt_t[d] > 0 and the token's B_t, C_t [N] (shared by the channels):
    h   = exp(dt_t[d] A[d]) * h + dt_t[d] x_t[d] B_t        A [d, N] negative
    y_t = C_t . h
(the `D` skip and the gate are the caller's). Unlike SSD, the decay differs per state
entry, so there is no cheap matrix form within a chunk.

Rows are those of the other chunked scans (`pallas_kernels.ragged.scan_rows`, aligned to
absolute positions), so the states at chunk boundaries are the states after absolute
positions that are multiples of `chunk_size`. The scan runs in two passes over the columns
of the [R, chunk_size] grid, every row at once: the first from zero states gives each row's
own contribution to its end state; a loop over rows then chains the rows of each sequence
(its first row starts from the initial state); the second pass replays the columns from
the rows' true start states and emits y. Empty cells have dt = 0 and x = 0: they neither
decay nor write.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import final_states, row_grid, tokens_since_latest_state


class SelectiveScanOutput(NamedTuple):
    """What the ragged scan returns (fields as the SSD scan's)."""

    y: jax.Array  # [T, d] float32; zero for padding tokens
    final_states: jax.Array  # [S, d, N] float32; the initial state for empty sequences
    chunk_states: jax.Array  # [R, d, N] float32: state after the last token of each row
    chunk_seq: jax.Array  # [R] int32: the row's sequence; S for unused rows
    chunk_end: jax.Array  # [R] int32: absolute position the row's state is at (exclusive end)


def validate_inputs(x, dt, A, B, C, init_states) -> None:
    """Raises ValueError unless the arguments have the shapes of `ragged_selective_scan`."""
    num_tokens, channels = x.shape
    state = A.shape[-1]
    if dt.shape != x.shape or A.shape != (channels, state):
        raise ValueError(f"inconsistent shapes: x {x.shape}, dt {dt.shape}, A {A.shape}")
    if B.shape != (num_tokens, state) or C.shape != B.shape:
        raise ValueError(f"B and C must be [T, N] = {(num_tokens, state)}, got {B.shape} and {C.shape}")
    if init_states.ndim != 3 or init_states.shape[1:] != (channels, state):
        raise ValueError(f"init_states must be [S, {channels}, {state}], got {init_states.shape}")


def _step(h: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array) -> jax.Array:
    """One token: h [..., d, N], x and dt [..., d], A [d, N], B [..., N] -> the new h."""
    return jnp.exp(dt[..., None] * A) * h + (dt * x)[..., None] * B[..., None, :]


def _columns(
    h0: jax.Array, xs: jax.Array, dts: jax.Array, A: jax.Array, Bs: jax.Array, Cs: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """Runs every row's columns from `h0` [R, d, N]; xs, dts [L, R, d], Bs, Cs [L, R, N].
    Returns the rows' end states and, with `Cs`, y [L, R, d]."""

    def column(h, inputs):
        x, dt, B, C = inputs
        h = _step(h, x, dt, A, B)
        return h, (None if C is None else jnp.einsum("rdn,rn->rd", h, C))

    return jax.lax.scan(column, h0, (xs, dts, Bs, Cs))


def ragged_selective_scan(
    x: jax.Array,  # [T, d]
    dt: jax.Array,  # [T, d] positive step sizes
    A: jax.Array,  # [d, N] negative
    B: jax.Array,  # [T, N]
    C: jax.Array,  # [T, N]
    init_states: jax.Array,  # [S, d, N]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32: absolute position of each sequence's first token
    *,
    chunk_size: int,
) -> SelectiveScanOutput:
    """Runs the selective scan over every sequence of a ragged batch."""
    validate_inputs(x, dt, A, B, C, init_states)
    num_tokens, channels = x.shape
    cells = row_grid(cu_seqlens, start_pos, num_tokens, chunk_size)
    rows = cells.rows
    num_rows = rows.chunk_seq.shape[0]
    f32 = jnp.float32
    A = A.astype(f32)
    columns_first = lambda t: jnp.moveaxis(cells.place(t.astype(f32)), 2, 0)  # noqa: E731  [T, k] -> [L, R, k]
    xs, dts, Bs, Cs = columns_first(x), columns_first(dt), columns_first(B), columns_first(C)

    own_end = _columns(jnp.zeros((num_rows, channels, A.shape[1]), f32), xs, dts, A, Bs)[0]
    row_decay = jnp.exp(dts.sum(axis=0)[..., None] * A)  # [R, d, N]: the whole row's decay

    is_first = rows.row_first.astype(bool)
    init_f32 = init_states.astype(f32)

    def chain(state, inputs):  # the rows in order: a sequence's first row starts from its initial state
        first, s, decay, own = inputs
        start = jnp.where(first, init_f32[s], state)
        return decay * start + own, start

    _, starts = jax.lax.scan(chain, jnp.zeros_like(init_f32[0]), (is_first, rows.row_seq, row_decay, own_end))
    ends, y_cols = _columns(starts, xs, dts, A, Bs, Cs)  # [R, d, N], [L, R, d]
    y = cells.take(jnp.moveaxis(y_cols, 0, 2))  # [T, d]
    return SelectiveScanOutput(y, final_states(rows, ends, init_states), ends, rows.chunk_seq, rows.chunk_end)


def selective_state_update(
    state: jax.Array,  # [S, d, N]
    x: jax.Array,  # [S, d]
    dt: jax.Array,  # [S, d] positive step sizes
    A: jax.Array,  # [d, N] negative
    B: jax.Array,  # [S, N]
    C: jax.Array,  # [S, N]
) -> tuple[jax.Array, jax.Array]:  # y [S, d] float32, new state [S, d, N] float32
    """Advances each sequence's state by one token (the decode step)."""
    f32 = jnp.float32
    new_state = _step(state.astype(f32), x.astype(f32), dt.astype(f32), A.astype(f32), B.astype(f32))
    return jnp.einsum("sdn,sn->sd", new_state, C.astype(f32)), new_state


def selective_states_at(
    x: jax.Array,  # [T, d]
    dt: jax.Array,  # [T, d]
    A: jax.Array,  # [d, N]
    B: jax.Array,  # [T, N]
    init_states: jax.Array,  # [S, d, N]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32
    scan: SelectiveScanOutput,  # the scan of exactly these inputs
    seq: jax.Array,  # [C] int32: sequence of each requested state
    pos: jax.Array,  # [C] int32: absolute position, start_pos[seq] < pos <= its last position + 1
    *,
    window: int,
) -> jax.Array:  # [C, d, N] float32
    """The state of sequence `seq[c]` after its tokens before absolute position `pos[c]`.

    Starts from the latest state the scan returned at or before `pos` (a row's end, or the
    sequence's initial state) and applies the tokens between one by one: `window` must bound
    them, i.e. be at least the scan's row length. Requests with `pos` out of range (padding)
    get garbage, never an error."""
    f32 = jnp.float32
    base, token, inside = tokens_since_latest_state(
        scan.chunk_seq,
        scan.chunk_end,
        scan.chunk_states,
        init_states,
        cu_seqlens,
        start_pos,
        seq,
        pos,
        window,
        x.shape[0],
    )
    dt_w = jnp.where(inside[..., None], dt[token].astype(f32), 0.0)  # [C, W, d]; the others neither decay nor write
    xs = jnp.moveaxis(x[token].astype(f32), 1, 0)  # [W, C, d]
    Bs = jnp.moveaxis(B[token].astype(f32), 1, 0)  # [W, C, N]
    return _columns(base, xs, jnp.moveaxis(dt_w, 1, 0), A.astype(f32), Bs)[0]
