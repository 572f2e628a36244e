"""Work list shared by the ragged paged attention kernels.

The flat token axis is cut into query blocks of `block_q` tokens, and into segments:
sequence `s` owns tokens `cu_q_lens[s]:cu_q_lens[s + 1]`, and one more segment, index
`num_seqs`, owns the padding tail `cu_q_lens[-1]:num_tokens`. A work item is one
(query block, segment) pair that may overlap; its tokens are the overlap. The items of a
batch therefore cover every token exactly once, and they come sorted by query block.

Every block holds at least one item (its first token's segment). Each further item of a
block starts a segment inside it, and at most `num_seqs` segments start after token 0, so
`num_blocks + num_seqs` items always suffice: the list has that static length, the real
items first, then fillers that repeat the last block with an empty token range.
Zero-length sequences may also yield items with an empty token range; kernels skip both.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class WorkItems(NamedTuple):
    """Per-item int32 arrays, all [num_work_items(...)]."""

    q_block: jax.Array  # query block index
    segment: jax.Array  # sequence index, or num_seqs for the padding tail
    q_start: jax.Array  # first token of the item (flat index)
    q_end: jax.Array  # one past its last token; <= q_start when the item is empty


def num_work_items(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static length of the work list."""
    return -(-num_tokens // block_q) + num_seqs


def work_items(cu_q_lens: jax.Array, num_tokens: int, block_q: int) -> WorkItems:
    """Builds the work list from cu_q_lens [S + 1] (nondecreasing, cu_q_lens[0] == 0)."""
    num_seqs = cu_q_lens.shape[0] - 1
    num_blocks = -(-num_tokens // block_q)
    num_items = num_work_items(num_tokens, num_seqs, block_q)
    # Segment g spans bounds[g]:bounds[g + 1]; segment num_seqs is the padding tail.
    bounds = jnp.minimum(jnp.append(cu_q_lens.astype(jnp.int32), num_tokens), num_tokens)  # [S + 2]
    block_start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q  # [num_blocks]
    block_end = jnp.minimum(block_start + block_q, num_tokens)
    # Segments holding each block's first and last tokens; those in between overlap it.
    first = jnp.searchsorted(bounds, block_start, side="right").astype(jnp.int32) - 1
    last = jnp.searchsorted(bounds, block_end - 1, side="right").astype(jnp.int32) - 1
    counts = last - first + 1
    offsets = jnp.cumsum(counts) - counts  # first item of each block

    item = jnp.arange(num_items, dtype=jnp.int32)
    block = jnp.searchsorted(offsets, item, side="right").astype(jnp.int32) - 1
    segment = jnp.minimum(first[block] + item - offsets[block], last[block])
    filler = item >= offsets[-1] + counts[-1]
    q_start = jnp.maximum(bounds[segment], block_start[block])
    q_end = jnp.where(filler, q_start, jnp.minimum(bounds[segment + 1], block_end[block]))
    return WorkItems(block, segment, q_start, q_end)
