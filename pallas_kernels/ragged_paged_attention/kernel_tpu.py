"""Ragged paged attention as a TPU (Mosaic) Pallas kernel.

Same signature and semantics as `reference.ragged_paged_attention`: one call attends a
whole ragged batch (prefill chunks, decode tokens, zero-length sequences, padding tokens)
to its paged KV cache, causally on absolute positions, with GQA, an optional sliding
window and an optional logit soft cap. The kernel only reads pages.

Algorithm
  * Work list (`_schedule.work_items`, built in the wrapper): the flat token axis is cut
    into query blocks of `block_q` tokens; each (query block, sequence) pair that overlaps
    is one work item, and the padding tail past `cu_q_lens[-1]` is one more "sequence"
    whose items attend to nothing (their rows come out 0). Grid = (KV-head blocks, work
    items). Items run in order, so consecutive items of one query block keep its output
    block resident in VMEM; each item writes only its own rows, and the items of a block
    cover all of them.
  * Scalar prefetch: kv_lens, page_indices (flattened), cu_q_lens and the work list sit
    in SMEM, where the index maps and the kernel read them.
  * Layout: q and the output are seen as [T, Hq * D] (T padded to a multiple of block_q)
    and pages as [page_size, Hkv * D] (free reshapes), so a KV head, or a query head, is a D-wide column slice: aligned to
    the 128 lanes when D is a multiple of 128, with no strided loads or relayouts. For KV
    head h the kernel stacks the G = Hq / Hkv query heads sharing it into one
    [G * block_q, D] matrix (row g * block_q + i: token i of the block, head g of the group).
  * KV: pages stay in HBM (memory_space ANY). An item needs the pages from the one holding
    its earliest visible key (sliding-window start, or 0) to the one holding its latest
    query's position; it walks them in KV blocks of `block_kv_pages` pages. Each block is
    copied page by page (the head block's columns of a page) into one of two VMEM slots
    with manual async copies: while one block is computed, the next one, or the next
    item's first block, is in flight (the chain restarts at each head block's first item,
    so the "parallel" head-block axis may be split across cores). Pages past the item's range are not copied; the
    mask hides what the slot still holds, and V rows there are zeroed (stale NaNs would
    otherwise leak through 0 * NaN in the PV matmul).
  * Compute, per KV head: scores = q k^T * sm_scale (f32 accumulation), optional soft cap,
    causal / window / range mask, then an online (flash) softmax across KV blocks with
    running max m, sum l and accumulator in VMEM scratch. Output acc / l; rows that see no
    key (padding) get exactly 0, as in the reference.

Block sizes (keyword-only; defaults reasoned for Hq=32, Hkv=8, D=128, page_size=16, bf16):
  * block_q: tokens per query block, a multiple of 16 (bf16 sublane tile). Default: enough
    for G * block_q = 256 MXU rows per KV head (64 tokens for G=4). Each KV block then
    serves 256 query rows, ~256 flop per byte loaded (about the v5e roofline), so prefill
    is not bound by re-reading KV per query block; a decode item uses only G of those rows
    yet stays memory bound (the MXU work per byte is the same).
  * block_kv_pages: pages per KV block. Default: 256 keys (16 pages of 16), 2 x 16 x 32 KiB
    = 1 MiB per block: long enough to hide the per-step overhead behind the DMA.
  * block_kv_heads: KV heads per grid row. Default: all (pages are copied as whole
    contiguous rows). Fewer (a divisor of Hkv with block_kv_heads * D a multiple of 128)
    gives the first grid axis several "parallel" blocks, for chips with two TensorCores.
  VMEM with the defaults: q and out blocks 2 x 2 x 512 KiB, K/V slots 2 MiB, f32 m/l/acc
  3 MiB, about 9 MiB: inside the 16 MiB default scoped VMEM.

Limits: q, k_pages and v_pages share one dtype (float32 or bfloat16); D a multiple of 128
keeps every slice lane-aligned (other D work, at the cost of lane shifts). `interpret=True`
runs on CPU under `pltpu.InterpretParams()`, which simulates DMAs and semaphores. Without a
TPU, only the Pallas-to-Mosaic lowering (`jax.export`) and interpret mode are checked;
Mosaic's layout passes run when a TPU compiles the kernel.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.ragged_paged_attention._schedule import work_items
from pallas_kernels.ragged_paged_attention.reference import validate_inputs

TARGET_ROWS = 256  # MXU rows per KV head per query block (see module docstring)
TARGET_KV_TOKENS = 256  # keys per KV block
LANES = 128  # m and l scratch are lane-replicated: Mosaic prefers whole vregs


class _Item(NamedTuple):
    """Scalars describing one work item."""

    seq: jax.Array  # sequence index, clamped into range (padding items read sequence S - 1)
    q_block: jax.Array  # query block index
    q_start: jax.Array  # first token (flat index)
    q_end: jax.Array  # one past the last token
    pos_offset: jax.Array  # absolute position of token t is t + pos_offset
    kv_end: jax.Array  # one past the last key any of its tokens sees
    first_page: jax.Array  # first page (index into the sequence's page list) to read
    end_page: jax.Array  # one past the last page to read
    num_kv_blocks: jax.Array  # KV blocks to walk; 0 for empty and padding items


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
    block_q: int | None = None,
    block_kv_pages: int | None = None,
    block_kv_heads: int | None = None,
    interpret: bool | pltpu.InterpretParams = False,
) -> jax.Array:  # [T, Hq, D]; zero for padding tokens
    """Pallas TPU version of `reference.ragged_paged_attention` (see module docstring).

    interpret: True runs on CPU under `pltpu.InterpretParams()`; an `InterpretParams`
    instance picks the simulation's options (race detection, eager DMAs, ...).
    """
    validate_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens)
    num_tokens, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    pages_per_seq = page_indices.shape[1]
    group = q_heads // kv_heads
    dtype = q.dtype
    if not (dtype == k_pages.dtype == v_pages.dtype) or dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"q, k_pages and v_pages must share dtype float32 or bfloat16, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    block_q = block_q or min(max(16, TARGET_ROWS // group // 16 * 16), -(-num_tokens // 16) * 16)
    if block_q % 16:
        raise ValueError(f"block_q must be a multiple of 16, got {block_q}")
    block_kv_pages = min(block_kv_pages or max(1, TARGET_KV_TOKENS // page_size), pages_per_seq)
    block_kv_heads = block_kv_heads or kv_heads
    if kv_heads % block_kv_heads or (block_kv_heads < kv_heads and block_kv_heads * head_dim % 128):
        raise ValueError(
            f"block_kv_heads ({block_kv_heads}) must divide kv_heads ({kv_heads}) and, unless equal, span a multiple of 128 lanes"
        )

    items = work_items(cu_q_lens, num_tokens, block_q)
    padded_tokens = -(-num_tokens // block_q) * block_q  # tokens past T belong to no item
    q_flat = jnp.pad(q.reshape(num_tokens, q_heads * head_dim), ((0, padded_tokens - num_tokens), (0, 0)))

    def block_map(head_block, item, kv_lens_ref, page_indices_ref, cu_q_lens_ref, q_block_ref, *_):
        return (q_block_ref[item], head_block)

    q_spec = pl.BlockSpec((block_q, block_kv_heads * group * head_dim), block_map)
    kv_block_shape = (2, block_kv_pages * page_size, block_kv_heads * head_dim)  # 2 slots
    rows = group * block_q  # query rows per KV head in a block
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        pages_per_seq=pages_per_seq,
        group=group,
        head_dim=head_dim,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=7,
            grid=(kv_heads // block_kv_heads, items.q_block.shape[0]),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM(kv_block_shape, dtype),  # K slots
                pltpu.VMEM(kv_block_shape, dtype),  # V slots
                pltpu.SemaphoreType.DMA((2,)),  # one per slot, shared by K and V
                pltpu.VMEM((block_kv_heads, rows, LANES), jnp.float32),  # running max m
                pltpu.VMEM((block_kv_heads, rows, LANES), jnp.float32),  # running sum l
                pltpu.VMEM((block_kv_heads, rows, head_dim), jnp.float32),  # accumulator
                pltpu.SMEM((1,), jnp.int32),  # slot holding the current item's first KV block
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_flat.shape, dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="ragged_paged_attention_tpu",
    )(
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),  # 1-D: SMEM pads 2-D arrays
        cu_q_lens.astype(jnp.int32),
        *items,
        q_flat,
        k_pages.reshape(num_pages, page_size, kv_heads * head_dim),
        v_pages.reshape(num_pages, page_size, kv_heads * head_dim),
    )
    return out[:num_tokens].reshape(num_tokens, q_heads, head_dim)


def _kernel(
    # Scalar prefetch (SMEM).
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S * pages_per_seq]
    cu_q_lens_ref,  # [S + 1]
    item_q_block_ref,  # [W]
    item_segment_ref,  # [W]
    item_q_start_ref,  # [W]
    item_q_end_ref,  # [W]
    # Inputs.
    q_ref,  # [block_q, block_kv_heads * G * D] VMEM block
    k_hbm,  # [num_pages, page_size, Hkv * D] HBM
    v_hbm,  # [num_pages, page_size, Hkv * D] HBM
    # Output.
    o_ref,  # [block_q, block_kv_heads * G * D] VMEM block
    # Scratch.
    k_bufs,  # [2, block_kv, block_kv_heads * D]: 2 slots, pages back to back
    v_bufs,  # [2, block_kv, block_kv_heads * D]
    sems,  # DMA [2]
    m_ref,  # [block_kv_heads, G * block_q, LANES] f32
    l_ref,  # [block_kv_heads, G * block_q, LANES] f32
    acc_ref,  # [block_kv_heads, G * block_q, D] f32
    slot_ref,  # SMEM [1] int32
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    pages_per_seq: int,
    group: int,
    head_dim: int,
):
    block_q = q_ref.shape[0]
    page_size = k_hbm.shape[1]
    block_kv = k_bufs.shape[1]
    block_kv_pages = block_kv // page_size
    heads_in_block = k_bufs.shape[2] // head_dim
    rows = group * block_q
    num_seqs = kv_lens_ref.shape[0]
    head_block = pl.program_id(0)
    item = pl.program_id(1)
    num_items = pl.num_programs(1)

    def describe(w) -> _Item:
        segment = item_segment_ref[w]
        seq = jnp.minimum(segment, num_seqs - 1)
        q_start, q_end = item_q_start_ref[w], item_q_end_ref[w]
        pos_offset = kv_lens_ref[seq] - cu_q_lens_ref[seq + 1]
        kv_end = jnp.clip(q_end + pos_offset, 0, pages_per_seq * page_size)
        kv_start = 0 if sliding_window is None else jnp.maximum(q_start + pos_offset - sliding_window + 1, 0)
        first_page = lax.div(kv_start, page_size)
        end_page = lax.div(kv_end + page_size - 1, page_size)
        live = (segment < num_seqs) & (q_end > q_start) & (end_page > first_page)
        num_kv_blocks = jnp.where(live, lax.div(end_page - first_page + block_kv_pages - 1, block_kv_pages), 0)
        return _Item(seq, item_q_block_ref[w], q_start, q_end, pos_offset, kv_end, first_page, end_page, num_kv_blocks)

    def block_copies(it: _Item, kv_block, slot):
        """(page in range, (K copy, V copy)) for each page of KV block `kv_block` of `it`."""
        columns = pl.ds(head_block * heads_in_block * head_dim, heads_in_block * head_dim)
        copies = []
        for j in range(block_kv_pages):
            page = it.first_page + kv_block * block_kv_pages + j
            page_id = page_indices_ref[it.seq * pages_per_seq + jnp.minimum(page, pages_per_seq - 1)]
            dst = (slot, pl.ds(j * page_size, page_size))
            k_copy = pltpu.make_async_copy(k_hbm.at[page_id, :, columns], k_bufs.at[dst], sems.at[slot])
            v_copy = pltpu.make_async_copy(v_hbm.at[page_id, :, columns], v_bufs.at[dst], sems.at[slot])
            copies.append((page < it.end_page, (k_copy, v_copy)))
        return copies

    def start(copies):
        for in_range, pair in copies:

            @pl.when(in_range)
            def _(pair=pair):
                for copy in pair:
                    copy.start()

    def wait(copies):
        for in_range, pair in copies:

            @pl.when(in_range)
            def _(pair=pair):
                for copy in pair:
                    copy.wait()

    cur = describe(item)
    nxt = describe(jnp.minimum(item + 1, num_items - 1))
    next_blocks = jnp.where(item + 1 < num_items, nxt.num_kv_blocks, 0)
    prev_blocks = jnp.where(item > 0, describe(jnp.maximum(item - 1, 0)).num_kv_blocks, 0)
    first_slot = jnp.where(item == 0, 0, slot_ref[0])

    # The previous item (same head block) prefetched our first block iff both have blocks.
    @pl.when((cur.num_kv_blocks > 0) & (prev_blocks == 0))
    def _():
        start(block_copies(cur, 0, first_slot))

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    # Absolute position of each query row, [G * block_q, block_kv] (row g * block_q + i).
    row_token = cur.q_block * block_q + lax.broadcasted_iota(jnp.int32, (group, block_q, block_kv), 1)
    row_pos = row_token.reshape(rows, block_kv) + cur.pos_offset
    precision = lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def q_head_cols(h, g):  # columns of query head g of local KV head h in q_ref / o_ref
        return pl.ds((h * group + g) * head_dim, head_dim)

    @pl.loop(0, cur.num_kv_blocks)
    def _(kv_block):
        slot = lax.rem(first_slot + kv_block, 2)

        @pl.when(kv_block + 1 < cur.num_kv_blocks)
        def _():
            start(block_copies(cur, kv_block + 1, 1 - slot))

        @pl.when((kv_block + 1 == cur.num_kv_blocks) & (next_blocks > 0))
        def _():
            start(block_copies(nxt, 0, 1 - slot))

        wait(block_copies(cur, kv_block, slot))

        kv_pos = (cur.first_page + kv_block * block_kv_pages) * page_size + lax.broadcasted_iota(
            jnp.int32, (rows, block_kv), 1
        )
        visible = (kv_pos <= row_pos) & (kv_pos < cur.kv_end)
        if sliding_window is not None:
            visible &= kv_pos > row_pos - sliding_window
        key_pos = (cur.first_page + kv_block * block_kv_pages) * page_size + lax.broadcasted_iota(
            jnp.int32, (block_kv, 1), 0
        )
        for h in range(heads_in_block):
            kv_cols = pl.ds(h * head_dim, head_dim)
            k = k_bufs[slot, :, kv_cols]  # [block_kv, D]
            v = jnp.where(key_pos < cur.kv_end, v_bufs[slot, :, kv_cols], 0)
            qh = jnp.concatenate([q_ref[:, q_head_cols(h, g)] for g in range(group)], axis=0)  # [rows, D]
            s = lax.dot_general(
                qh, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
            )
            s = s * sm_scale
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            s = jnp.where(visible, s, -jnp.inf)
            m_prev = m_ref[h]  # [rows, LANES]
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that see no key yet
            p = jnp.exp(s - m_safe[:, :1])
            alpha = jnp.exp(m_prev - m_safe)
            m_ref[h] = m_next
            l_ref[h] = alpha * l_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
            acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv

    slot_ref[0] = lax.rem(first_slot + cur.num_kv_blocks, 2)

    token = cur.q_block * block_q + lax.broadcasted_iota(jnp.int32, (block_q, head_dim), 0)
    own_row = (token >= cur.q_start) & (token < cur.q_end)
    for h in range(heads_in_block):
        total = l_ref[h][:, :1]
        out = jnp.where(total > 0, acc_ref[h] / jnp.where(total > 0, total, 1.0), 0.0).astype(o_ref.dtype)
        for g in range(group):
            cols = q_head_cols(h, g)
            o_ref[:, cols] = jnp.where(own_row, out[g * block_q : (g + 1) * block_q], o_ref[:, cols])
