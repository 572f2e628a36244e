"""Pure-jnp reference for the Mamba2 SSD scan over a ragged batch.

The recurrence, per head h (state [P, N]):
    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t B_t^T
    y_t     = state_t C_t
Inputs are already discretised upstream except for the `exp(dt * A)` decay: `dt` is the
positive step size (softplus and clamping done by the caller; zero for padding), and the
D skip connection and the gate are the caller's too.

Chunks are aligned to *absolute* positions: a sequence whose first token this step sits at
position p starts in chunk `p // chunk_size` with a short first chunk, so the states at
chunk boundaries (returned in `chunk_states`) are the states after absolute positions that
are multiples of `chunk_size`, whichever step computed them. Chunks never cross sequences.

Implementation: every (sequence, absolute chunk) pair that has tokens gets a row of a
`[R, chunk_size]` grid (the row bookkeeping is `_layout.scan_rows`, shared with the Pallas
kernels), each token placed at column `position % chunk_size`; empty cells have
dt = 0, which neither decays nor feeds the state. The quadratic intra-chunk form runs on
every row at once, then a loop over rows carries states, restarting at each sequence's
first row from its initial state.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import scan_rows, token_segments, tokens_since_latest_state


class RaggedScanOutput(NamedTuple):
    """What the ragged scan returns."""

    y: jax.Array  # [T, H, P] float32; zero for padding tokens
    final_states: jax.Array  # [S, H, P, N] float32; the initial state for empty sequences
    chunk_states: jax.Array  # [R, H, P, N] float32: state after the last token of each row
    chunk_seq: jax.Array  # [R] int32: the row's sequence; S for unused rows
    chunk_end: jax.Array  # [R] int32: absolute position the row's state is at (exclusive end)


def _segsum(a: jax.Array) -> jax.Array:
    """[..., L] -> [..., L, L] with out[..., i, j] = sum(a[..., j+1 : i+1]) for i >= j, else -inf.

    Built from masked cumulative sums rather than differences of one cumsum, which keeps
    precision when the decay over a chunk is large."""
    size = a.shape[-1]
    expanded = jnp.broadcast_to(a[..., :, None], (*a.shape, size))  # [..., k, j] = a[k]
    strictly_lower = jnp.tril(jnp.ones((size, size), dtype=bool), k=-1)
    sums = jnp.cumsum(jnp.where(strictly_lower, expanded, 0.0), axis=-2)
    lower = jnp.tril(jnp.ones((size, size), dtype=bool))
    return jnp.where(lower, sums, -jnp.inf)


def _heads(t: jax.Array, num_heads: int) -> jax.Array:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return jnp.repeat(t, num_heads // t.shape[-2], axis=-2)


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
) -> RaggedScanOutput:
    """Runs the SSD recurrence over every sequence of a ragged batch."""
    num_tokens, num_heads, head_dim = x.shape
    num_seqs = init_states.shape[0]
    state_size = B.shape[-1]
    if x.shape[0] != dt.shape[0] or B.shape != C.shape or num_heads % B.shape[-2]:
        raise ValueError(f"inconsistent shapes: x {x.shape}, dt {dt.shape}, B {B.shape}, C {C.shape}")
    if init_states.shape[1:] != (num_heads, head_dim, state_size):
        raise ValueError(f"init_states must be [S, {num_heads}, {head_dim}, {state_size}], got {init_states.shape}")
    cs = chunk_size
    rows = scan_rows(cu_seqlens, start_pos, num_tokens, cs)  # one row per (sequence, absolute chunk)
    num_rows = rows.chunk_seq.shape[0]

    seq, local, valid = token_segments(cu_seqlens, num_tokens)
    pos = start_pos[seq] + local  # [T] absolute positions
    # Used rows cover the real tokens in order, each from its row_start (unused rows start at T).
    token_row = jnp.searchsorted(rows.row_start, jnp.arange(num_tokens), side="right") - 1
    row = jnp.where(valid, token_row, num_rows)  # out of range: dropped
    col = pos % cs

    f32 = jnp.float32
    dt = jnp.where(valid[:, None], dt.astype(f32), 0.0)
    xdt = x.astype(f32) * dt[..., None]

    def grid(values: jax.Array) -> jax.Array:
        """[T, ...] -> [R, cs, ...], padding cells zero."""
        out = jnp.zeros((num_rows, cs, *values.shape[1:]), values.dtype)
        return out.at[row, col].set(values, mode="drop")

    xg = grid(xdt)  # [R, cs, H, P]
    adt = jnp.moveaxis(grid(dt * A.astype(f32)), 1, 2)  # [R, H, cs]
    Bg = _heads(grid(B.astype(f32)), num_heads)  # [R, cs, H, N]
    Cg = _heads(grid(C.astype(f32)), num_heads)

    a_cum = jnp.cumsum(adt, axis=-1)  # [R, H, cs]
    # 1. Within each row, the quadratic ("attention-like") form, every row at once.
    decay = jnp.exp(_segsum(adt))  # [R, H, cs(l), cs(s)]
    scores = jnp.einsum("rlhn,rshn->rhls", Cg, Bg) * decay
    y_diag = jnp.einsum("rhls,rshp->rlhp", scores, xg)

    # 2. A loop over rows carries the state: a sequence's first row starts from its initial
    #    state; each row adds its starting state's contribution to its outputs, and its end
    #    state is the decayed start plus the row's own inputs. Working row by row keeps the
    #    [H, P, N] states out of [R, ...] temporaries unless `chunk_states` is used.
    seq_of_row = rows.row_seq
    is_first = rows.row_first.astype(bool)
    is_last = (rows.chunk_seq < num_seqs) & (jnp.arange(num_rows) == rows.last_row[seq_of_row])
    init_f32 = jnp.asarray(init_states, f32)

    def row_step(carry, inputs):
        state, finals = carry  # [H, P, N], [S + 1, H, P, N] (row S: scratch)
        first, last, seq, x_r, B_r, C_r, a_r = inputs  # x_r [cs, H, P], B_r/C_r [cs, H, N], a_r [H, cs]
        start = jnp.where(first, init_f32[seq], state)
        y_off = jnp.einsum("lhn,hpn,hl->lhp", C_r, start, jnp.exp(a_r))
        to_end = jnp.exp(a_r[:, -1:] - a_r)  # [H, cs]
        end = jnp.exp(a_r[:, -1])[:, None, None] * start + jnp.einsum("lhn,hl,lhp->hpn", B_r, to_end, x_r)
        finals = finals.at[jnp.where(last, seq, num_seqs)].set(end)
        return (end, finals), (y_off, end)

    state_shape = (num_heads, head_dim, state_size)
    carry = (jnp.zeros(state_shape, f32), jnp.zeros((num_seqs + 1, *state_shape), f32))
    per_row = (is_first, is_last, seq_of_row, xg, Bg, Cg, a_cum)
    (_, finals), (y_off, end_states) = jax.lax.scan(row_step, carry, per_row)  # [R, cs, H, P], [R, H, P, N]
    y_grid = y_diag + y_off  # [R, cs, H, P]
    y = jnp.where(valid[:, None, None], y_grid[jnp.clip(row, 0, num_rows - 1), col], 0.0)
    final_states = jnp.where((rows.seq_len > 0)[:, None, None, None], finals[:num_seqs], init_f32)
    return RaggedScanOutput(y, final_states, end_states, rows.chunk_seq, rows.chunk_end)


def ssd_state_update(
    state: jax.Array,  # [S, H, P, N]
    x: jax.Array,  # [S, H, P]
    dt: jax.Array,  # [S, H] positive step sizes
    A: jax.Array,  # [H] negative
    B: jax.Array,  # [S, G, N]
    C: jax.Array,  # [S, G, N]
) -> tuple[jax.Array, jax.Array]:  # y [S, H, P] float32, new state [S, H, P, N] float32
    """Advances each sequence's state by one token (the decode step)."""
    f32 = jnp.float32
    num_heads = x.shape[1]
    dt = dt.astype(f32)
    Bh = _heads(B.astype(f32), num_heads)  # [S, H, N]
    Ch = _heads(C.astype(f32), num_heads)
    decay = jnp.exp(dt * A.astype(f32))  # [S, H]
    new_state = decay[..., None, None] * state.astype(f32) + jnp.einsum("sh,shp,shn->shpn", dt, x.astype(f32), Bh)
    y = jnp.einsum("shpn,shn->shp", new_state, Ch)
    return y, new_state


def ssd_states_at(
    x: jax.Array,  # [T, H, P]
    dt: jax.Array,  # [T, H] positive step sizes
    A: jax.Array,  # [H] negative
    B: jax.Array,  # [T, G, N]
    init_states: jax.Array,  # [S, H, P, N]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32
    scan: RaggedScanOutput,  # the scan of exactly these inputs
    seq: jax.Array,  # [C] int32: sequence of each requested state
    pos: jax.Array,  # [C] int32: absolute position, start_pos[seq] < pos <= its last position + 1
    *,
    window: int,
) -> jax.Array:  # [C, H, P, N] float32
    """The state of sequence `seq[c]` after its tokens before absolute position `pos[c]`.

    Starts from the latest state the scan returned at or before `pos` (a row's end, or the
    sequence's initial state) and applies the few tokens between: `window` must bound them,
    i.e. be at least the scan's row length (its chunk size). Requests with `pos` out of range
    (padding) get garbage, never an error."""
    f32 = jnp.float32
    num_tokens, num_heads, _ = x.shape
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
        num_tokens,
    )
    dt_w = jnp.where(inside[..., None], dt[token].astype(f32), 0.0)  # [C, W, H]
    a_cum = jnp.cumsum(dt_w * A.astype(f32), axis=1)
    to_end = jnp.exp(a_cum[:, -1:, :] - a_cum)  # decay from after each token to pos
    x_w = x[token].astype(f32) * dt_w[..., None]  # [C, W, H, P]
    B_w = _heads(B[token].astype(f32), num_heads)  # [C, W, H, N]
    inputs = jnp.einsum("cwh,cwhp,cwhn->chpn", to_end, x_w, B_w)
    return jnp.exp(a_cum[:, -1, :])[..., None, None] * base + inputs
