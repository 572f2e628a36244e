"""Pure-jnp reference for ragged paged attention.

Layout (shared with the Pallas kernels that will match this signature):
  * the queries of every sequence in the step lie on one flat token axis, sequence `s`
    owning tokens `cu_q_lens[s]:cu_q_lens[s + 1]`; tokens past `cu_q_lens[-1]` are padding;
  * keys and values live in pages `[num_pages, page_size, kv_heads, head_dim]`; sequence `s`
    owns pages `page_indices[s, :]`, and its context is `kv_lens[s]` tokens long, this step's
    tokens included (they are the last ones), so a query's absolute position is
    `kv_lens[s] - (cu_q_lens[s + 1] - t)`;
  * attention is causal on absolute positions, with an optional sliding window and logit
    soft-cap; query heads are grouped over KV heads (GQA).
Page 0 is a null sink: padding writes there and nothing valid reads it.
"""

import math

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import token_segments


def validate_inputs(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [S] int32
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
) -> None:
    """Checks shapes and dtypes statically; raises ValueError naming the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [tokens, q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(
            f"k_pages and v_pages must be equal [pages, page_size, kv_heads, head_dim], got {k_pages.shape} and {v_pages.shape}"
        )
    if k_pages.shape[3] != q.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k_pages ({k_pages.shape[3]}) differ")
    if q.shape[1] % k_pages.shape[2]:
        raise ValueError(f"q_heads ({q.shape[1]}) must be a multiple of kv_heads ({k_pages.shape[2]})")
    num_seqs = kv_lens.shape[0]
    if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs:
        raise ValueError(f"page_indices must be [{num_seqs}, pages_per_seq], got {page_indices.shape}")
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [{num_seqs + 1}], got {cu_q_lens.shape}")
    for name, arr in (("kv_lens", kv_lens), ("page_indices", page_indices), ("cu_q_lens", cu_q_lens)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {arr.dtype}")


def write_kv_pages(
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # [T] int32: page * page_size + offset; padding -> 0 (null page)
) -> tuple[jax.Array, jax.Array]:
    """Scatters this step's keys and values into their pages."""
    page_size = k_pages.shape[1]
    # A 4-D scatter: through a flattened view XLA copies the whole pool on every step.
    page, offset = slot_mapping // page_size, slot_mapping % page_size
    k_pages = k_pages.at[page, offset].set(k.astype(k_pages.dtype))
    v_pages = v_pages.at[page, offset].set(v.astype(v_pages.dtype))
    return k_pages, v_pages


QUERY_BLOCK = 32  # query tokens attended at a time: bounds the temporaries of a long step
KV_CHUNK = 128  # context positions scored at a time (rounded down to whole pages)


def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, D]
    kv_lens: jax.Array,  # [S] int32: context length, this step's tokens included
    page_indices: jax.Array,  # [S, pages_per_seq] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    per_sequence: bool | None = None,
) -> jax.Array:  # [T, Hq, D]; zero for padding tokens
    """Attends each query token to the cached context of its own sequence.

    Query tokens go through in blocks of up to `QUERY_BLOCK` (a loop), and each block reads
    the context in chunks of `KV_CHUNK` positions with an online softmax (an inner loop), only
    the chunks its queries can see: from the first position the sliding window lets in to the
    block's last query position. A step's cost follows the context its sequences have, not
    the `pages_per_seq` the page table could hold. Two ways to lay out a chunk, with equal
    results:
      * per token: each token gathers its own sequence's chunk, [block, chunk, Hkv, D] — the
        context copied once per query token, cheap only when each sequence has few;
      * per sequence: the chunk of every sequence is gathered, [S * chunk, Hkv, D], and each
        token scores against all of them with the other sequences masked out, [block, Hq,
        S * chunk] scores.
    `per_sequence=None` takes the cheaper one: per sequence when the scores of S contexts
    (S * Hq per position, each costing about four times a copied value on a CPU: product,
    exponential, sum, normalisation) cost less than a token's own K and V copies (2 * Hkv * D
    per position)."""
    validate_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens)
    k_pages, v_pages, page_indices = jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(page_indices)
    num_tokens, q_heads, head_dim = q.shape
    num_seqs, pages_per_seq = page_indices.shape
    _, page_size, kv_heads, _ = k_pages.shape
    if per_sequence is None:
        per_sequence = 4 * num_seqs * q_heads < 2 * kv_heads * head_dim
    group = q_heads // kv_heads
    seq, _, valid = token_segments(cu_q_lens, num_tokens)
    q_pos = kv_lens[seq] - (cu_q_lens[seq + 1] - jnp.arange(num_tokens))  # [T]
    chunk_pages = max(1, min(pages_per_seq, KV_CHUNK // page_size))
    num_chunks = -(-pages_per_seq // chunk_pages)
    # Padded with the null page so that every chunk's slice lies inside the table.
    page_indices = jnp.pad(page_indices, ((0, 0), (0, num_chunks * chunk_pages - pages_per_seq)))
    chunk = chunk_pages * page_size

    def attend_chunk(c, carry, block):  # adds context chunk c to a block's running softmax
        m, total, acc = carry  # [B, Hkv, G] running max, [B, Hkv, G] running sum, [B, Hkv, G, D]
        qg, seq, q_pos, valid = block  # [B, Hkv, G, D], [B], [B], [B]
        pages = jax.lax.dynamic_slice_in_dim(page_indices, c * chunk_pages, chunk_pages, axis=1)  # [S, P]
        pos = c * chunk + jnp.arange(chunk)  # [chunk]
        if per_sequence:
            k = k_pages[pages].reshape(num_seqs * chunk, kv_heads, head_dim)  # [J = S * chunk, Hkv, D]
            v = v_pages[pages].reshape(num_seqs * chunk, kv_heads, head_dim)
            mask = jnp.repeat(jnp.arange(num_seqs), chunk)[None, :] == seq[:, None]  # [B, J]
            pos = jnp.tile(pos, num_seqs)
            scores_eq, out_eq = "tkgd,jkd->tkgj", "tkgj,jkd->tkgd"
        else:
            k = k_pages[pages[seq]].reshape(seq.shape[0], chunk, kv_heads, head_dim)  # [B, J = chunk, Hkv, D]
            v = v_pages[pages[seq]].reshape(seq.shape[0], chunk, kv_heads, head_dim)
            mask = jnp.ones((seq.shape[0], chunk), bool)
            scores_eq, out_eq = "tkgd,tjkd->tkgj", "tkgj,tjkd->tkgd"
        scores = jnp.einsum(scores_eq, qg, k, preferred_element_type=jnp.float32) * sm_scale  # [B, Hkv, G, J]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        mask &= pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > q_pos[:, None] - sliding_window
        mask &= valid[:, None]
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        probs = jnp.exp(scores - m_new[..., None])  # 0 where masked
        rescale = jnp.exp(m - m_new)
        total = total * rescale + probs.sum(axis=-1)
        out = jnp.einsum(out_eq, probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, total, acc * rescale[..., None] + out

    def attend_block(block):  # one block of B query tokens -> [B, Hkv, G, D]
        qg, _, q_pos, valid = block
        last = jnp.max(jnp.where(valid, q_pos, -1))  # -1: a block of padding reads nothing
        first = jnp.min(jnp.where(valid, q_pos - (sliding_window or num_chunks * chunk) + 1, last))
        lo, hi = jnp.maximum(first, 0) // chunk, (last + 1 + chunk - 1) // chunk
        stats = jnp.full(qg.shape[:3], jnp.finfo(jnp.float32).min, jnp.float32)
        init = (stats, jnp.zeros(qg.shape[:3], jnp.float32), jnp.zeros(qg.shape, jnp.float32))
        _, total, acc = jax.lax.fori_loop(lo, hi, lambda c, carry: attend_chunk(c, carry, block), init)
        return acc / jnp.where(total > 0, total, 1.0)[..., None]

    block = math.gcd(num_tokens, QUERY_BLOCK)
    qg = q.reshape(num_tokens // block, block, kv_heads, group, head_dim)
    blocks = (qg, *(a.reshape(num_tokens // block, block) for a in (seq, q_pos, valid)))
    out = jax.lax.map(attend_block, blocks)  # [T / B, B, Hkv, G, D]
    return out.reshape(num_tokens, q_heads, head_dim).astype(q.dtype)
