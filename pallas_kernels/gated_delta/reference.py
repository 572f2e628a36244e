"""Pure-jnp reference for the gated delta rule (Gated DeltaNet) over a ragged batch.

The recurrence, per value head h (state S [d_k, d_v]), for token t with query q_t and key
k_t [d_k] (L2-normalised by the caller; q scaled by `scale` here), value v_t [d_v], log-decay
g_t <= 0 and learning rate beta_t in (0, 1):
    S'  = exp(g_t) S
    S   = S' + k_t (beta_t (v_t - S'^T k_t))^T
    o_t = S^T q_t
Value heads are grouped over key heads: value head h reads key head h // (H_v / H_k).

Chunks are aligned to *absolute* positions, exactly like the SSD scan (the rows are
`pallas_kernels.ragged.scan_rows`): the states at chunk boundaries are the states after
absolute positions that are multiples of `chunk_size`, whichever step computed them.

Within a row of L tokens (the chunked form of Yang et al., "Gated Delta Networks", 2024),
with G_i = g_1 + ... + g_i and D_ij = exp(G_i - G_j) for i >= j:
    M   = I + strictly_lower(beta_i k_i . k_j D_ij)            [L, L], unit lower triangular
    U   = M^-1 (beta v),  W = M^-1 (beta exp(G) k)             [L, d_v], [L, d_k]
    V'  = U - W S0                                              the corrections the state writes
    O   = (exp(G) q) S0 + lower(q_i . k_j D_ij) V'              [L, d_v]
    S_L = exp(G_L) S0 + (exp(G_L - G) k)^T V'
Empty cells of a row have g = 0, beta = 0 and k = q = 0: they neither decay nor write.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import row_grid, tokens_since_latest_state


class GatedDeltaOutput(NamedTuple):
    """What the ragged scan returns (fields as the SSD scan's)."""

    o: jax.Array  # [T, H_v, d_v] float32; zero for padding tokens
    final_states: jax.Array  # [S, H_v, d_k, d_v] float32; the initial state for empty sequences
    chunk_states: jax.Array  # [R, H_v, d_k, d_v] float32: state after the last token of each row
    chunk_seq: jax.Array  # [R] int32: the row's sequence; S for unused rows
    chunk_end: jax.Array  # [R] int32: absolute position the row's state is at (exclusive end)


def value_heads(t: jax.Array, num_value_heads: int) -> jax.Array:
    """[..., H_k, d] -> [..., H_v, d]: value head h reads key head h // (H_v / H_k)."""
    return jnp.repeat(t, num_value_heads // t.shape[-2], axis=-2)


def validate_inputs(q, k, v, g, beta, init_states) -> None:
    """Raises ValueError unless the arguments have the shapes of `ragged_gated_delta`."""
    num_tokens, num_key_heads, key_dim = k.shape
    num_heads, value_dim = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != num_tokens or num_heads % num_key_heads:
        raise ValueError(f"inconsistent shapes: q {q.shape}, k {k.shape}, v {v.shape}")
    if g.shape != (num_tokens, num_heads) or beta.shape != g.shape:
        raise ValueError(f"g and beta must be [T, H_v] = {(num_tokens, num_heads)}, got {g.shape} and {beta.shape}")
    if init_states.ndim != 4 or init_states.shape[1:] != (num_heads, key_dim, value_dim):
        raise ValueError(f"init_states must be [S, {num_heads}, {key_dim}, {value_dim}], got {init_states.shape}")


class _Block(NamedTuple):
    """The per-block terms of the chunked form, every block (and head) at once."""

    cum: jax.Array  # [..., H, L] G, the inclusive cumulative log-decay
    U: jax.Array  # [..., H, L, d_v]
    W: jax.Array  # [..., H, L, d_k]
    decay: jax.Array  # [..., H, L, L] D_ij for i >= j, else 0


def _block_terms(k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array) -> _Block:
    """k [..., H, L, d_k], v [..., H, L, d_v], g and beta [..., H, L], all float32."""
    size = g.shape[-1]
    cum = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((size, size), dtype=bool))
    strictly_lower = jnp.tril(jnp.ones((size, size), dtype=bool), k=-1)
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    kk = jnp.einsum("...id,...jd->...ij", k, k) * beta[..., :, None] * decay
    rhs = jnp.concatenate([v * beta[..., None], k * (beta * jnp.exp(cum))[..., None]], axis=-1)
    solved = _unit_lower_solve(jnp.where(strictly_lower, kk, 0.0), rhs)
    return _Block(cum, solved[..., : v.shape[-1]], solved[..., v.shape[-1] :], decay)


def _unit_lower_solve(strict: jax.Array, rhs: jax.Array) -> jax.Array:
    """X with (I + strict) X = rhs, by forward substitution: strict [..., L, L] strictly lower
    triangular, rhs [..., L, d]. (Not `lax.linalg.triangular_solve`: on XLA:CPU it is a LAPACK
    call, and programs holding several of them were seen to hang.)"""

    def row(i, x):  # rows < i of x are solved, the others zero
        solved_i = rhs[..., i, :] - jnp.einsum("...j,...jd->...d", strict[..., i, :], x)
        return x.at[..., i, :].set(solved_i)

    return jax.lax.fori_loop(0, strict.shape[-1], row, jnp.zeros_like(rhs))


def _advance(start: jax.Array, k: jax.Array, block: _Block) -> tuple[jax.Array, jax.Array]:
    """The block's corrections V' [..., H, L, d_v] and end state [..., H, d_k, d_v] from
    `start` [..., H, d_k, d_v]; k [..., H, L, d_k]."""
    corrections = block.U - jnp.einsum("...ld,...dv->...lv", block.W, start)
    to_end = jnp.exp(block.cum[..., -1:] - block.cum)  # [..., H, L]
    end = jnp.exp(block.cum[..., -1])[..., None, None] * start + jnp.einsum(
        "...ld,...lv->...dv", k * to_end[..., None], corrections
    )
    return corrections, end


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
) -> GatedDeltaOutput:
    """Runs the gated delta rule over every sequence of a ragged batch."""
    validate_inputs(q, k, v, g, beta, init_states)
    num_tokens, _, key_dim = k.shape
    num_heads, value_dim = v.shape[1:]
    num_seqs = init_states.shape[0]
    cells = row_grid(cu_seqlens, start_pos, num_tokens, chunk_size)
    rows = cells.rows
    num_rows = rows.chunk_seq.shape[0]

    f32 = jnp.float32
    qh = cells.place(value_heads(q.astype(f32) * scale, num_heads))  # [R, H, cs, d_k]
    kh = cells.place(value_heads(k.astype(f32), num_heads))
    block = _block_terms(kh, cells.place(v.astype(f32)), cells.place(g.astype(f32)), cells.place(beta.astype(f32)))
    intra = jnp.einsum("rhid,rhjd->rhij", qh, kh) * block.decay  # [R, H, cs, cs]
    q_decayed = qh * jnp.exp(block.cum)[..., None]

    # A loop over rows carries the state: a sequence's first row starts from its initial state.
    is_first = rows.row_first.astype(bool)
    is_last = (rows.chunk_seq < num_seqs) & (jnp.arange(num_rows) == rows.last_row[rows.row_seq])
    init_f32 = jnp.asarray(init_states, f32)

    def row_step(carry, inputs):
        state, finals = carry  # [H, d_k, d_v], [S + 1, H, d_k, d_v] (row S: scratch)
        first, last, s, k_r, q_r, intra_r, b_r = inputs
        start = jnp.where(first, init_f32[s], state)
        corrections, end = _advance(start, k_r, b_r)
        o = jnp.einsum("hld,hdv->hlv", q_r, start) + jnp.einsum("hij,hjv->hiv", intra_r, corrections)
        finals = finals.at[jnp.where(last, s, num_seqs)].set(end)
        return (end, finals), (o, end)

    state_shape = (num_heads, key_dim, value_dim)
    carry = (jnp.zeros(state_shape, f32), jnp.zeros((num_seqs + 1, *state_shape), f32))
    per_row = (is_first, is_last, rows.row_seq, kh, q_decayed, intra, block)
    (_, finals), (o_rows, end_states) = jax.lax.scan(row_step, carry, per_row)  # [R, H, cs, d_v], [R, H, d_k, d_v]
    o = cells.take(o_rows)  # [T, H, d_v]
    final_states = jnp.where((rows.seq_len > 0)[:, None, None, None], finals[:num_seqs], init_f32)
    return GatedDeltaOutput(o, final_states, end_states, rows.chunk_seq, rows.chunk_end)


def gated_delta_update(
    state: jax.Array,  # [S, H_v, d_k, d_v]
    q: jax.Array,  # [S, H_k, d_k] L2-normalised
    k: jax.Array,  # [S, H_k, d_k] L2-normalised
    v: jax.Array,  # [S, H_v, d_v]
    g: jax.Array,  # [S, H_v]
    beta: jax.Array,  # [S, H_v]
    *,
    scale: float,
) -> tuple[jax.Array, jax.Array]:  # o [S, H_v, d_v] float32, new state [S, H_v, d_k, d_v] float32
    """Advances each sequence's state by one token (the decode step)."""
    f32 = jnp.float32
    num_heads = v.shape[1]
    q = value_heads(q.astype(f32), num_heads) * scale
    k = value_heads(k.astype(f32), num_heads)
    decayed = jnp.exp(g.astype(f32))[..., None, None] * state.astype(f32)
    delta = (v.astype(f32) - jnp.einsum("shdv,shd->shv", decayed, k)) * beta.astype(f32)[..., None]
    new_state = decayed + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("shdv,shd->shv", new_state, q), new_state


def gated_delta_states_at(
    k: jax.Array,  # [T, H_k, d_k]
    v: jax.Array,  # [T, H_v, d_v]
    g: jax.Array,  # [T, H_v]
    beta: jax.Array,  # [T, H_v]
    init_states: jax.Array,  # [S, H_v, d_k, d_v]
    cu_seqlens: jax.Array,  # [S + 1] int32
    start_pos: jax.Array,  # [S] int32
    scan: GatedDeltaOutput,  # the scan of exactly these inputs
    seq: jax.Array,  # [C] int32: sequence of each requested state
    pos: jax.Array,  # [C] int32: absolute position, start_pos[seq] < pos <= its last position + 1
    *,
    window: int,
) -> jax.Array:  # [C, H_v, d_k, d_v] float32
    """The state of sequence `seq[c]` after its tokens before absolute position `pos[c]`.

    Starts from the latest state the scan returned at or before `pos` (a row's end, or the
    sequence's initial state) and applies the few tokens between as one block: `window` must
    bound them, i.e. be at least the scan's row length. Requests with `pos` out of range
    (padding) get garbage, never an error."""
    f32 = jnp.float32
    num_tokens = k.shape[0]
    num_heads = v.shape[1]
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
    # The others neither decay nor write.
    k_w = jnp.where(inside[..., None, None], value_heads(k[token].astype(f32), num_heads), 0.0)  # [C, W, H, d_k]
    g_w = jnp.where(inside[..., None], g[token].astype(f32), 0.0)  # [C, W, H]
    beta_w = jnp.where(inside[..., None], beta[token].astype(f32), 0.0)
    heads_first = lambda x: jnp.moveaxis(x, 1, 2)  # noqa: E731  [C, W, H, ...] -> [C, H, W, ...]
    k_w = heads_first(k_w)
    block = _block_terms(k_w, heads_first(v[token].astype(f32)), heads_first(g_w), heads_first(beta_w))
    _, end = _advance(base, k_w, block)
    return end
