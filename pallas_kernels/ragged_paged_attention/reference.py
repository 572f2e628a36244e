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
        raise ValueError(f"k_pages and v_pages must be equal [pages, page_size, kv_heads, head_dim], got {k_pages.shape} and {v_pages.shape}")
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

    Query tokens go through in blocks of up to `QUERY_BLOCK` (a loop), so the temporaries
    stay small however long the step. Two ways to lay out the context, with equal results:
      * per token: each sequence's pages are gathered once, K as [S, Hkv, D, ctx] and V as
        [S, Hkv, ctx, D] (the layouts the two products read), and each token takes its own
        sequence's, [block, Hkv, D, ctx] — the context copied once per query token, cheap
        only when each sequence has few;
      * per sequence: each sequence's pages are gathered once, [S * ctx, Hkv, D], and every
        token scores against all of them with the other sequences masked out, [block, Hq,
        S * ctx] scores.
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
    ctx = pages_per_seq * page_size
    k_seqs = k_pages[page_indices].reshape(num_seqs, ctx, kv_heads, head_dim)  # [S, ctx, Hkv, D]
    v_seqs = v_pages[page_indices].reshape(num_seqs, ctx, kv_heads, head_dim)
    if per_sequence:
        k_all = k_seqs.reshape(num_seqs * ctx, kv_heads, head_dim)  # [S * ctx, Hkv, D]
        v_all = v_seqs.reshape(num_seqs * ctx, kv_heads, head_dim)
        key_seq = jnp.repeat(jnp.arange(num_seqs), ctx)  # [S * ctx]
        key_pos = jnp.tile(jnp.arange(ctx), num_seqs)
    else:
        # Transposed once here rather than once per query token inside the loop.
        k_seqs = k_seqs.transpose(0, 2, 3, 1)  # [S, Hkv, D, ctx]
        v_seqs = v_seqs.transpose(0, 2, 1, 3)  # [S, Hkv, ctx, D]

    def attend_block(block):  # one block of B query tokens -> [B, Hkv, G, D]
        qg, seq, q_pos, valid = block  # [B, Hkv, G, D], [B], [B], [B]
        if per_sequence:
            k, v = k_all, v_all  # [J = S * ctx, Hkv, D]
            pos = key_pos
            mask = key_seq[None, :] == seq[:, None]  # [B, J]
            scores_eq, out_eq = "tkgd,jkd->tkgj", "tkgj,jkd->tkgd"
        else:
            k, v = k_seqs[seq], v_seqs[seq]  # [B, Hkv, D, J = ctx], [B, Hkv, J, D]
            pos = jnp.arange(ctx)
            mask = jnp.ones((seq.shape[0], ctx), bool)
            scores_eq, out_eq = "tkgd,tkdj->tkgj", "tkgj,tkjd->tkgd"
        scores = jnp.einsum(scores_eq, qg, k, preferred_element_type=jnp.float32) * sm_scale  # [B, Hkv, G, J]
        if soft_cap is not None:
            scores = soft_cap * jnp.tanh(scores / soft_cap)
        mask &= pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= pos[None, :] > q_pos[:, None] - sliding_window
        mask &= valid[:, None]
        scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(mask[:, None, None, :], probs, 0.0)  # padding rows are all -inf
        return jnp.einsum(out_eq, probs.astype(v.dtype), v, preferred_element_type=jnp.float32)

    block = math.gcd(num_tokens, QUERY_BLOCK)
    qg = q.reshape(num_tokens // block, block, kv_heads, group, head_dim)
    blocks = (qg, *(a.reshape(num_tokens // block, block) for a in (seq, q_pos, valid)))
    out = jax.lax.map(attend_block, blocks)  # [T / B, B, Hkv, G, D]
    return out.reshape(num_tokens, q_heads, head_dim).astype(q.dtype)
