"""Row metadata shared by the SSD reference and Pallas kernels, and per-token decays.

The kernels must lay out chunk rows exactly like `reference.ragged_ssd_scan` (same
`num_scan_rows`, same row order, same `chunk_seq` / `chunk_end`), so the reference and the
kernels all take their row bookkeeping from `scan_rows`, which also gives what a kernel needs
to find a row's tokens on the flat token axis: each row is a contiguous token range
[row_start, row_start + row_len) of at most chunk_size tokens, rows come in token order, and
together the used rows cover exactly the real tokens [0, cu_seqlens[-1]).

It also computes, in plain XLA, the two O(T * H) per-token inputs of the kernels: the step
size with padding zeroed and the cumulative log-decay *within each row*,
    cum[t, h] = sum of dt[u, h] * A[h] over the tokens u <= t of t's row,
by a segmented scan (sums never cross a row, so they keep full float32 precision).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import token_segments


def num_scan_rows(num_tokens: int, num_seqs: int, chunk_size: int) -> int:
    """Static bound on the rows of the chunk grid: each sequence of L tokens spans at most
    ceil(L / chunk_size) + 1 chunks, and every row holds at least one token."""
    return min(num_tokens, num_tokens // chunk_size + 2 * num_seqs)


class ScanRows(NamedTuple):
    """Per-row metadata of the chunk grid; R = num_scan_rows(T, S, chunk_size)."""

    chunk_seq: jax.Array  # [R] int32: the row's sequence; S for unused rows (as the reference)
    chunk_end: jax.Array  # [R] int32: absolute end position of the row; 0 for unused rows
    row_start: jax.Array  # [R] int32: flat index of the row's first token; T for unused rows
    row_len: jax.Array  # [R] int32: tokens in the row (1..chunk_size); 0 for unused rows
    row_first: jax.Array  # [R] int32: 1 if the row starts its sequence (restart from init state)
    row_seq: jax.Array  # [R] int32: chunk_seq clipped to [0, S - 1], safe for indexing
    num_used: jax.Array  # [] int32: number of used rows; rows [0, num_used) are used
    last_row: jax.Array  # [S] int32: each sequence's last row, clipped into [0, R - 1]
    seq_len: jax.Array  # [S] int32: tokens of each sequence this step


def validate_inputs(x, dt, A, B, C, init_states, cu_seqlens, start_pos, chunk_size) -> None:
    """Raises ValueError unless the arguments have the shapes and dtypes of `ragged_ssd_scan`."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if x.ndim != 3:
        raise ValueError(f"x must be [T, H, P], got shape {x.shape}")
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens < 1:
        raise ValueError("x must hold at least one token")
    if dt.shape != (num_tokens, num_heads):
        raise ValueError(f"dt must be [T, H] = {(num_tokens, num_heads)}, got {dt.shape}")
    if A.shape != (num_heads,):
        raise ValueError(f"A must be [H] = {(num_heads,)}, got {A.shape}")
    if B.ndim != 3 or B.shape[0] != num_tokens or B.shape != C.shape:
        raise ValueError(f"B and C must both be [T, G, N] with T = {num_tokens}, got {B.shape} and {C.shape}")
    num_groups, state_size = B.shape[1:]
    if num_groups < 1 or num_heads % num_groups:
        raise ValueError(f"the {num_heads} heads must split evenly over the {num_groups} groups of B and C")
    if init_states.ndim != 4 or init_states.shape[1:] != (num_heads, head_dim, state_size):
        raise ValueError(f"init_states must be [S, {num_heads}, {head_dim}, {state_size}], got {init_states.shape}")
    num_seqs = init_states.shape[0]
    if num_seqs < 1:
        raise ValueError("init_states must hold at least one sequence")
    if cu_seqlens.shape != (num_seqs + 1,) or start_pos.shape != (num_seqs,):
        raise ValueError(
            f"cu_seqlens must be [S + 1] = {(num_seqs + 1,)} and start_pos [S] = {(num_seqs,)}, "
            f"got {cu_seqlens.shape} and {start_pos.shape}"
        )
    for name, arr in (("cu_seqlens", cu_seqlens), ("start_pos", start_pos)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {arr.dtype}")
    for name, arr in (("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("init_states", init_states)):
        if arr.dtype not in (jnp.float32, jnp.bfloat16):
            raise ValueError(f"{name} must be float32 or bfloat16, got {arr.dtype}")


def scan_rows(cu_seqlens: jax.Array, start_pos: jax.Array, num_tokens: int, chunk_size: int) -> ScanRows:
    """Row metadata of the chunk grid (one row per sequence and absolute chunk it touches).

    cu_seqlens: [S + 1] int; start_pos: [S] int.
    """
    cs = chunk_size
    num_seqs = start_pos.shape[0]
    num_rows = num_scan_rows(num_tokens, num_seqs, cs)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    start_pos = start_pos.astype(jnp.int32)

    seq_len = cu_seqlens[1:] - cu_seqlens[:-1]  # [S]
    first_chunk = start_pos // cs
    last_chunk = (start_pos + seq_len - 1) // cs
    rows_per_seq = jnp.where(seq_len > 0, last_chunk - first_chunk + 1, 0)
    cu_rows = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(rows_per_seq).astype(jnp.int32)])

    rows = jnp.arange(num_rows, dtype=jnp.int32)
    chunk_seq = jnp.searchsorted(cu_rows, rows, side="right").astype(jnp.int32) - 1
    used = chunk_seq < num_seqs
    chunk_seq = jnp.where(used, chunk_seq, num_seqs)
    row_seq = jnp.clip(chunk_seq, 0, num_seqs - 1)
    row_first = used & (rows == cu_rows[row_seq])

    chunk_of_row = first_chunk[row_seq] + rows - cu_rows[row_seq]
    seq_end = (start_pos + seq_len)[row_seq]
    chunk_end = jnp.where(used, jnp.minimum((chunk_of_row + 1) * cs, seq_end), 0)
    first_pos = jnp.maximum(chunk_of_row * cs, start_pos[row_seq])  # absolute position of the row's first token
    row_start = jnp.where(used, cu_seqlens[row_seq] + first_pos - start_pos[row_seq], num_tokens)
    row_len = jnp.where(used, chunk_end - first_pos, 0)

    return ScanRows(
        chunk_seq=chunk_seq,
        chunk_end=chunk_end.astype(jnp.int32),
        row_start=row_start.astype(jnp.int32),
        row_len=row_len.astype(jnp.int32),
        row_first=row_first.astype(jnp.int32),
        row_seq=row_seq,
        num_used=jnp.minimum(cu_rows[-1], num_rows),
        last_row=jnp.clip(cu_rows[1:] - 1, 0, num_rows - 1),
        seq_len=seq_len,
    )


def row_decays(
    dt: jax.Array,  # [T, H]
    A: jax.Array,  # [H]
    cu_seqlens: jax.Array,  # [S + 1]
    start_pos: jax.Array,  # [S]
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:  # dt [T, H] float32 (zero for padding), cum [T, H] float32
    """Masked step sizes and the within-row inclusive cumulative sum of dt * A."""
    num_tokens = dt.shape[0]
    seq, local, valid = token_segments(cu_seqlens.astype(jnp.int32), num_tokens)
    pos = start_pos.astype(jnp.int32)[seq] + local
    starts_row = (local == 0) | (pos % chunk_size == 0)  # [T]: first token of its row
    dt = jnp.where(valid[:, None], dt.astype(jnp.float32), 0.0)
    log_decay = dt * A.astype(jnp.float32)

    def combine(left, right):
        left_start, left_sum = left
        right_start, right_sum = right
        return left_start | right_start, jnp.where(right_start, right_sum, left_sum + right_sum)

    flags = jnp.broadcast_to(starts_row[:, None], log_decay.shape)
    _, cum = jax.lax.associative_scan(combine, (flags, log_decay), axis=0)
    return dt, cum


def final_states(rows: ScanRows, chunk_states: jax.Array, init_states: jax.Array) -> jax.Array:
    """[S, H, P, N] float32: each sequence's state after its last row; its initial state if empty.

    chunk_states: [R, H, P, N] float32; init_states: [S, H, P, N].
    """
    has_tokens = (rows.seq_len > 0)[:, None, None, None]
    return jnp.where(has_tokens, chunk_states[rows.last_row], init_states.astype(jnp.float32))
