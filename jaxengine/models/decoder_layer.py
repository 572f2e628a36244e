"""One decoder layer of the hybrid stack: an optional mixer and an optional feed-forward, each
a pre-norm residual branch."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.config import LayerSpec, ModelConfig
from jaxengine.models.layers import Mlp, Moe, RMSNorm, norm_settings
from jaxengine.models.mixers import MIXERS
from jaxengine.models.shared_block import SharedBlockUse


def add_residual(cfg: ModelConfig, h: jax.Array, out: jax.Array) -> jax.Array:
    """`h + r * out`, r the model's `residual_multiplier`."""
    return h + out * cfg.residual_multiplier if cfg.residual_multiplier != 1.0 else h + out


class DecoderLayer(nnx.Module):
    """`x + r * mixer(norm(x))`, then `x + r * ffn(norm(x))`, each branch when present; with
    a parallel mixer, `x + r * (mixer(norm(x)) + parallel(norm(x)))`; with a shared block,
    `x + r * mixer(norm(x + shared(x)))` (`shared_block.py`; the layer holds its `shared_use`).

    A mixer is the attribute named after its type ("attention", "mamba", ...)."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.spec = spec
        norm = norm_settings(cfg, dtype)
        if spec.shared_block is not None:
            self.shared_use = SharedBlockUse(cfg, dtype=dtype, rngs=rngs)
        if spec.mixers:
            self.mixer_norm = RMSNorm(cfg.hidden_size, **norm)
        for name in spec.mixers:
            kind = MIXERS[name]
            setattr(
                self, name, kind.module(cfg.hidden_size, kind.config(cfg), cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
            )
        if spec.ffn is not None:
            self.ffn_norm = RMSNorm(cfg.hidden_size, **norm)
        if spec.ffn == "mlp":
            self.mlp = Mlp(cfg.hidden_size, cfg.mlp, dtype=dtype, rngs=rngs)
        elif spec.ffn == "moe":
            self.moe = Moe(cfg.hidden_size, cfg.moe, dtype=dtype, rngs=rngs)

    def feed_forward(self, cfg: ModelConfig, h: jax.Array) -> jax.Array:
        """The feed-forward branch added to `h` [T, D] (`h` itself without one)."""
        if self.spec.ffn is None:
            return h
        ffn = self.mlp if self.spec.ffn == "mlp" else self.moe
        return add_residual(cfg, h, ffn(self.ffn_norm(h)))
