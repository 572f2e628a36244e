"""Input checks of the SSD scans, and per-token decays for the Pallas kernels.

The kernels lay out chunk rows exactly like `reference.ragged_ssd_scan`: all of them take
their row bookkeeping from `pallas_kernels.ragged.scan_rows`.

This module also computes, in plain XLA, the two O(T * H) per-token inputs of the kernels: the step
size with padding zeroed and the cumulative log-decay *within each row*,
    cum[t, h] = sum of dt[u, h] * A[h] over the tokens u <= t of t's row,
by a segmented scan (sums never cross a row, so they keep full float32 precision).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import token_segments


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
