"""Zamba2's shared transformer blocks, and what each use of one adds: low-rank adapters and
an output projection (`SharedBlockConfig`).

A block's weights are held once, in `HybridLM.shared_blocks`; a layer that uses one holds
its `SharedBlockUse`. Each use attends over KV pages of its own: its inputs differ.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.attention import Attention
from jaxengine.models.batch import StepBatch, TokenLayout
from jaxengine.models.config import ModelConfig
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import Mlp, RMSNorm, linear, norm_settings


class LowRank(nnx.Module):
    """`up(down(x))`, no biases: a low-rank adapter added to a projection's output."""

    def __init__(self, in_features: int, out_features: int, rank: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.down = linear(in_features, rank, bias=False, dtype=dtype, rngs=rngs)
        self.up = linear(rank, out_features, bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, in] -> [T, out]
        return self.up(self.down(x))


class SharedBlockUse(nnx.Module):
    """One layer's use of a shared block: adapters on the MLP's gate | up (`gate_up`) and,
    with attention adapters, on q, k and v; and `proj`, the block output's projection."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        shared, attn, hidden = cfg.shared_block, cfg.attention, cfg.hidden_size
        rank = shared.adapter_rank
        if shared.attention_adapters:
            q_width, kv_width = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
            self.q = LowRank(2 * hidden, q_width, rank, dtype=dtype, rngs=rngs)
            self.k = LowRank(2 * hidden, kv_width, rank, dtype=dtype, rngs=rngs)
            self.v = LowRank(2 * hidden, kv_width, rank, dtype=dtype, rngs=rngs)
        self.gate_up = LowRank(hidden, 2 * cfg.mlp.intermediate_size, rank, dtype=dtype, rngs=rngs)
        self.proj = linear(hidden, hidden, bias=False, dtype=dtype, rngs=rngs)

    def qkv(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array] | None:
        """The q, k and v adapters' outputs for the normed block input `x` [T, 2D], or None."""
        return (self.q(x), self.k(x), self.v(x)) if hasattr(self, "q") else None


class SharedBlock(nnx.Module):
    """Attention over RMSNorm(concat(h, embeddings)) (width 2D in, D out), then the gated MLP
    over the RMS-normed attention output; no residual inside the block."""

    def __init__(self, cfg: ModelConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden = cfg.hidden_size
        norm = norm_settings(cfg, dtype)
        self.input_norm = RMSNorm(2 * hidden, **norm)
        self.attention = Attention(2 * hidden, cfg.attention, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, out_size=hidden)
        self.ffn_norm = RMSNorm(hidden, **norm)
        self.mlp = Mlp(hidden, cfg.mlp, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        h: jax.Array,  # [T, D] the residual stream
        embeddings: jax.Array,  # [T, D] the input embeddings
        k_pages: jax.Array,  # this use's [num_pages, page_size, Hkv, head_dim]
        v_pages: jax.Array,
        use: SharedBlockUse,
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Returns what the use adds to its layer's input (`use.proj` of the block's output)
        [T, D] and the use's updated k and v pages."""
        x = self.input_norm(jnp.concatenate([h, embeddings], axis=-1))
        out, k_pages, v_pages = self.attention(x, k_pages, v_pages, batch, layout, ops, deltas=use.qkv(x))
        y = self.ffn_norm(out)
        return use.proj(self.mlp(y, use.gate_up(y))), k_pages, v_pages
