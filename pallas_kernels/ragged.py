"""Helpers shared by the ragged references: mapping flat tokens to their sequences.

A ragged batch puts the tokens of all sequences on one flat axis; `cu_seqlens[s]` is the
offset of sequence `s` and `cu_seqlens[s + 1] - cu_seqlens[s]` its length this step.
Padded sequences have length zero; tokens at or past `cu_seqlens[-1]` are padding.

The chunked scans (SSD, gated delta rule) cut each sequence into *rows*: one per absolute
chunk of `chunk_size` positions it has tokens in (`scan_rows`). The references and the
Pallas kernels must lay rows out identically (same number, order, `chunk_seq`, `chunk_end`),
so all of them take their bookkeeping from here. Each row is a contiguous token range
[row_start, row_start + row_len) of at most chunk_size tokens, rows come in token order, and
together the used rows cover exactly the real tokens [0, cu_seqlens[-1]).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


def token_segments(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns, for each flat token, its sequence index, its index within that
    sequence, and whether it is a real token (not padding).

    cu_seqlens: [S + 1] int32.  Returns three [num_tokens] arrays (int32, int32, bool).
    Padding tokens get sequence index S - 1 clipped into range and `valid == False`.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
    valid = seq < num_seqs
    seq = jnp.clip(seq, 0, num_seqs - 1)
    local = t - cu_seqlens[seq]
    return seq, local, valid


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


class RowGrid(NamedTuple):
    """Where each flat token sits in the [R, chunk_size] grid of a scan's rows."""

    rows: ScanRows
    row: jax.Array  # [T] int32: the token's row; R (out of range) for padding
    col: jax.Array  # [T] int32: its column, position % chunk_size
    valid: jax.Array  # [T] bool
    chunk_size: int

    def place(self, values: jax.Array) -> jax.Array:
        """[T, H, ...] -> [R, H, chunk_size, ...] (H: any one axis), padding and empty cells zero."""
        num_rows, chunk = self.rows.chunk_seq.shape[0], self.chunk_size
        values = jnp.where(self.valid.reshape(-1, *[1] * (values.ndim - 1)), values, 0)
        out = jnp.zeros((num_rows, chunk, *values.shape[1:]), values.dtype)
        return jnp.swapaxes(out.at[self.row, self.col].set(values, mode="drop"), 1, 2)

    def take(self, grid: jax.Array) -> jax.Array:
        """[R, H, chunk_size, ...] -> [T, H, ...], zero for padding."""
        out = grid[jnp.clip(self.row, 0, grid.shape[0] - 1), :, self.col]
        return jnp.where(self.valid.reshape(-1, *[1] * (out.ndim - 1)), out, 0.0)


def row_grid(cu_seqlens: jax.Array, start_pos: jax.Array, num_tokens: int, chunk_size: int) -> RowGrid:
    rows = scan_rows(cu_seqlens, start_pos, num_tokens, chunk_size)  # one row per (sequence, absolute chunk)
    seq, local, valid = token_segments(cu_seqlens, num_tokens)
    token_row = jnp.searchsorted(rows.row_start, jnp.arange(num_tokens), side="right") - 1
    row = jnp.where(valid, token_row, rows.chunk_seq.shape[0])
    return RowGrid(rows, row, (start_pos[seq] + local) % chunk_size, valid, chunk_size)


def final_states(rows: ScanRows, chunk_states: jax.Array, init_states: jax.Array) -> jax.Array:
    """[S, ...] float32: each sequence's state after its last row; its initial state if empty.

    chunk_states: [R, ...] float32; init_states: [S, ...].
    """
    has_tokens = (rows.seq_len > 0).reshape(-1, *[1] * (chunk_states.ndim - 1))
    return jnp.where(has_tokens, chunk_states[rows.last_row], init_states.astype(jnp.float32))


def tokens_since_latest_state(
    chunk_seq: jax.Array,  # [R] int32: a scan's rows' sequences
    chunk_end: jax.Array,  # [R] int32: the absolute positions their end states are at
    chunk_states: jax.Array,  # [R, ...] float32: the rows' end states
    init_states: jax.Array,  # [S, ...]: each sequence's state before the step
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32
    seq: jax.Array,  # [C] int32: sequence of each requested state
    pos: jax.Array,  # [C] int32: absolute position the state is asked after
    window: int,
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For each request, the latest state a chunked scan returned at or before `pos` (a row's
    end, or the sequence's initial state) [C, ...] float32, and the flat indices [C, window]
    of the tokens between it and `pos`, with a mask [C, window] of those that exist (at most
    `window` of them: it must be at least the scan's row length)."""
    is_base = (chunk_seq[None, :] == seq[:, None]) & (chunk_end[None, :] <= pos[:, None])  # [C, R]
    base_row = jnp.argmax(jnp.where(is_base, chunk_end[None, :], -1), axis=1)
    has_row = is_base.any(axis=1)
    seq_start = start_pos[seq]
    base_pos = jnp.where(has_row, chunk_end[base_row], seq_start)
    mask = has_row.reshape(-1, *[1] * (chunk_states.ndim - 1))
    base = jnp.where(mask, chunk_states[base_row], init_states[seq].astype(jnp.float32))
    token_pos = base_pos[:, None] + jnp.arange(window)[None, :]  # [C, W]
    inside = token_pos < pos[:, None]
    token = jnp.clip(cu_seqlens[seq][:, None] + token_pos - seq_start[:, None], 0, num_tokens - 1)
    return base, token, inside
