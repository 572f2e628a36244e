"""Grouped-query attention over the paged KV pool."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import HEADS, KV_HEADS
from jaxengine.models.batch import StepBatch, TokenLayout
from jaxengine.models.config import AttentionConfig
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import RMSNorm, apply_rope, linear


class Attention(nnx.Module):
    """Projects (q_proj: each head's query, then its gate with `output_gate`), normalises
    each head's q and k (`qk_norm`), rotates, writes this step's K/V into its pages, attends
    over each sequence's pages with ragged paged attention and gates the output.

    `out_size`: the output projection's width when it is not the input's (Zamba2's shared
    block attends over width 2 * hidden and returns width hidden)."""

    def __init__(
        self,
        hidden_size: int,
        cfg: AttentionConfig,
        eps: float,
        *,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
        out_size: int | None = None,
    ):
        self.cfg = cfg
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_out = 2 * q_width if cfg.output_gate else q_width
        self.q_proj = linear(hidden_size, q_out, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(None, HEADS))
        self.k_proj = linear(hidden_size, kv_width, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(None, KV_HEADS))
        self.v_proj = linear(hidden_size, kv_width, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(None, KV_HEADS))
        self.o_proj = linear(
            q_width, out_size or hidden_size, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(HEADS, None)
        )
        if cfg.qk_norm:
            norm = dict(dtype=dtype, weight_offset=cfg.qk_norm_offset)
            self.q_norm = RMSNorm(cfg.head_dim, eps, **norm)
            self.k_norm = RMSNorm(cfg.head_dim, eps, **norm)

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        k_pages: jax.Array,  # [num_pages, page_size, Hkv, head_dim]
        v_pages: jax.Array,
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
        deltas: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [T, D], new k_pages, new v_pages
        q, gate, k, v = self.project(x, layout.positions, deltas)
        k_pages, v_pages = ops.write_kv_pages(k_pages, v_pages, k, v, layout.slot_mapping)
        return self.attend(q, gate, k_pages, v_pages, batch, ops), k_pages, v_pages

    def project(
        self, x: jax.Array, positions: jax.Array, deltas: tuple[jax.Array, jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
        """x [T, D] at `positions` [T] -> rotated q [T, H, d], its gate (or None), rotated k and v [T, Hkv, d].

        `deltas`, when given, are added to the q, k and v projections ([T, H * d], [T, Hkv * d]
        twice: low-rank adapters' outputs, `shared_block.py`)."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if deltas is not None:
            q, k, v = q + deltas[0], k + deltas[1], v + deltas[2]
        q = q.reshape(num_tokens, cfg.num_heads, -1)
        gate = None
        if cfg.output_gate:
            q, gate = jnp.split(q, 2, axis=-1)  # [T, H, head_dim] each
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rotary_dim:
            q = apply_rope(q, positions, cfg.rotary_dim, cfg.rope_theta)
            k = apply_rope(k, positions, cfg.rotary_dim, cfg.rope_theta)
        return q, gate, k, v

    def attend(
        self,
        q: jax.Array,
        gate: jax.Array | None,
        k_pages: jax.Array,
        v_pages: jax.Array,
        batch: StepBatch,
        ops: KernelOps,
    ) -> jax.Array:
        """Ragged paged attention of q over the pages (this step's K/V written), gated -> [T, D]."""
        out = ops.ragged_paged_attention(
            q, k_pages, v_pages, batch.kv_lens, batch.page_table, batch.cu_q_lens, sm_scale=self.cfg.sm_scale
        )
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out.reshape(q.shape[0], -1))
