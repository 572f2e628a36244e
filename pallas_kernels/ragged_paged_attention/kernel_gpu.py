"""Ragged paged attention as a GPU Pallas kernel (Triton backend).

Same signature and semantics as `reference.ragged_paged_attention`: one call attends a
whole ragged batch (prefill chunks, decode tokens, zero-length sequences, padding tokens)
to its paged KV cache, causally on absolute positions, with GQA, an optional sliding
window and an optional logit soft cap. The kernel only reads pages.

Why Triton, not Mosaic GPU: with jax 0.10.2 a Mosaic GPU kernel lowers and exports for
CUDA on this CPU-only machine, but it cannot run in interpret mode, the only way to test
it here. q·Kᵀ needs K transposed as the wgmma B operand (computing Sᵀ = K·Qᵀ instead moves
the problem to P·V, which then needs Pᵀ or Vᵀ); Mosaic GPU expresses that with
`plgpu.transpose_ref` (it has no register transpose, and TMA copies cannot transpose), and
the 0.10.2 GPU interpreter's wgmma accepts only indexing transforms on its operands: a
transposed operand fails with "'TransposeTransform' object has no attribute 'indices'".
The Triton backend runs with `interpret=True` and lowers for CUDA. Its custom call
(`__gpu$xla.gpu.triton`) has no export compatibility guarantee, so `jax.export` needs
`disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]`.
Pallas' Triton backend is deprecated from JAX 0.11: port to Mosaic GPU once its
interpreter handles transposed operands.

Algorithm
  * Work list (`_schedule.work_items`): the flat token axis is cut into query blocks of
    `block_q` tokens; each (query block, sequence) pair that overlaps is one item, and the
    padding tail past `cu_q_lens[-1]` is one more "sequence" whose items attend to nothing
    (their rows come out 0). The items partition the tokens, so each program writes its own
    rows with masked stores and programs never overlap. Grid = (work items, KV heads).
  * A program stacks the G = Hq / Hkv query heads of its KV head into one matrix, row
    g * block_q + i = token i of the block, head g (G rounded up to a power of two, as
    Triton needs power-of-two shapes; the extra rows are masked). q rows are gathered from
    q viewed as [T * Hq, D].
  * KV: the program walks the keys from its earliest visible one (sliding-window start, or
    0) to its latest query's position in blocks of `block_kv` keys. Each key's row in the
    pages (viewed as [num_pages * page_size * Hkv, D]) is gathered through page_indices
    with masked loads, so keys outside the range read nothing and come back as 0
    (num_stages=2 lets Triton overlap the next block's loads with this block's math).
  * Compute: scores = q kᵀ * sm_scale (f32 accumulation; float32 inputs use IEEE f32 dots,
    not TF32), optional soft cap, causal / window mask, online (flash) softmax with running
    max, sum and accumulator in registers; output acc / sum, 0 for rows that see no key.

Block sizes (keyword-only; defaults for Hq=32, Hkv=8, D=128, page_size=16, bf16):
  * block_q (power of two; at least 16 rows, as Triton's dot needs 16 along each dim):
    tokens per query block. Default: G * block_q = 64 rows, the usual flash-attention tile
    for 4 warps (16 tokens for G=4); a decode item uses only G rows of it, but decode is
    bound by loading the keys, not by the MMA.
  * block_kv (power of two, at least 16): keys per step. Default 64: the [64, 128] K and V tiles plus
    the [64, 64] scores fit in registers with 4 warps, and 64 keys are 4 pages of 16.
Limits: q, k_pages and v_pages share one dtype (float32, bfloat16 or float16); D a power of two.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.ragged_paged_attention._schedule import work_items
from pallas_kernels.ragged_paged_attention.reference import validate_inputs

TARGET_ROWS = 64  # query rows per program (see module docstring)
DEFAULT_BLOCK_KV = 64  # keys per step


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


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
    block_kv: int = DEFAULT_BLOCK_KV,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]; zero for padding tokens
    """Pallas GPU (Triton) version of `reference.ragged_paged_attention` (see module docstring)."""
    validate_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens)
    num_tokens, q_heads, head_dim = q.shape
    num_pages, page_size, kv_heads, _ = k_pages.shape
    group = q_heads // kv_heads
    dtype = q.dtype
    if not (dtype == k_pages.dtype == v_pages.dtype) or dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"q, k_pages and v_pages must share dtype float32, bfloat16 or float16, got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}"
        )
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be positive, got {sliding_window}")
    padded_group = _next_power_of_2(group)
    block_q = block_q or max(1, TARGET_ROWS // padded_group)
    for name, size in (("block_q", block_q), ("block_kv", block_kv), ("head_dim", head_dim)):
        if size != _next_power_of_2(size):
            raise ValueError(f"{name} must be a power of two, got {size}")
    if padded_group * block_q < 16 or block_kv < 16:  # Triton's dot needs 16 along each dim
        raise ValueError(
            f"need at least 16 query rows (G rounded up to a power of two times block_q) and block_kv >= 16, got {padded_group * block_q} and {block_kv}"
        )

    items = work_items(cu_q_lens, num_tokens, block_q)
    kernel = functools.partial(
        _kernel,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        block_q=block_q,
        block_kv=block_kv,
        group=group,
        padded_group=padded_group,
        page_size=page_size,
        kv_heads=kv_heads,
    )
    out = pl.pallas_call(
        kernel,
        grid=(items.q_block.shape[0], kv_heads),
        out_shape=jax.ShapeDtypeStruct((num_tokens * q_heads, head_dim), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(
        kv_lens.astype(jnp.int32),
        page_indices.astype(jnp.int32).reshape(-1),
        cu_q_lens.astype(jnp.int32),
        *items,
        q.reshape(num_tokens * q_heads, head_dim),
        k_pages.reshape(num_pages * page_size * kv_heads, head_dim),
        v_pages.reshape(num_pages * page_size * kv_heads, head_dim),
    )
    return out.reshape(num_tokens, q_heads, head_dim)


def _kernel(
    kv_lens_ref,  # [S]
    page_indices_ref,  # [S * pages_per_seq]
    cu_q_lens_ref,  # [S + 1]
    item_q_block_ref,  # [W]
    item_segment_ref,  # [W]
    item_q_start_ref,  # [W]
    item_q_end_ref,  # [W]
    q_ref,  # [T * Hq, D]: row t * Hq + head
    k_ref,  # [num_pages * page_size * Hkv, D]: row (page * page_size + slot) * Hkv + kv_head
    v_ref,  # [num_pages * page_size * Hkv, D]
    o_ref,  # [T * Hq, D]
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    block_q: int,
    block_kv: int,
    group: int,
    padded_group: int,
    page_size: int,
    kv_heads: int,
):
    num_seqs = kv_lens_ref.shape[0]
    pages_per_seq = page_indices_ref.shape[0] // num_seqs
    head_dim = q_ref.shape[1]
    item, kv_head = pl.program_id(0), pl.program_id(1)

    segment = item_segment_ref[item]
    seq = jnp.minimum(segment, num_seqs - 1)
    q_start, q_end = item_q_start_ref[item], item_q_end_ref[item]
    pos_offset = kv_lens_ref[seq] - cu_q_lens_ref[seq + 1]  # position of token t is t + pos_offset
    kv_end = jnp.clip(q_end + pos_offset, 0, pages_per_seq * page_size)  # one past the last visible key
    kv_start = 0 if sliding_window is None else jnp.maximum(q_start + pos_offset - sliding_window + 1, 0)
    live = (segment < num_seqs) & (q_end > q_start) & (kv_end > kv_start)
    num_kv_blocks = jnp.where(live, lax.div(kv_end - kv_start + block_kv - 1, block_kv), 0)

    rows = padded_group * block_q
    row = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    g, i = row // block_q, row % block_q
    token = item_q_block_ref[item] * block_q + i
    row_ok = (g < group) & (token >= q_start) & (token < q_end)  # [rows]
    row_pos = token + pos_offset
    cols = lax.broadcasted_iota(jnp.int32, (rows, head_dim), 1)
    q_rows = (token * kv_heads * group + kv_head * group + g)[:, None]
    q = plgpu.load(q_ref.at[q_rows, cols], mask=row_ok[:, None], other=0)  # [rows, D]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kv_cols = lax.broadcasted_iota(jnp.int32, (block_kv, head_dim), 1)

    def kv_step(kv_block, carry):
        m, total, acc = carry  # running max, running sum of p, accumulator
        kv_pos = kv_start + kv_block * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
        key_ok = kv_pos < kv_end
        page = plgpu.load(page_indices_ref.at[seq * pages_per_seq + kv_pos // page_size], mask=key_ok, other=0)
        kv_rows = ((page * page_size + kv_pos % page_size) * kv_heads + kv_head)[:, None]
        k = plgpu.load(k_ref.at[kv_rows, kv_cols], mask=key_ok[:, None], other=0)  # [block_kv, D]
        v = plgpu.load(v_ref.at[kv_rows, kv_cols], mask=key_ok[:, None], other=0)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        visible = key_ok[None, :] & (kv_pos[None, :] <= row_pos[:, None])
        if sliding_window is not None:
            visible &= kv_pos[None, :] > row_pos[:, None] - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that see no key yet
        p = jnp.exp(s - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        return m_next, alpha * total + jnp.sum(p, axis=1), alpha[:, None] * acc + pv

    init = (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, head_dim), jnp.float32),
    )
    _, total, acc = lax.fori_loop(0, num_kv_blocks, kv_step, init)
    out = jnp.where(total[:, None] > 0, acc / jnp.where(total > 0, total, 1.0)[:, None], 0.0)
    plgpu.store(o_ref.at[q_rows, cols], out.astype(o_ref.dtype), mask=row_ok[:, None])
