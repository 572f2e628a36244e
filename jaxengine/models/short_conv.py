"""LFM2's short-convolution mixer: its per-sequence state (the conv window only) and its step."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import RECURRENT, param
from jaxengine.models.batch import StepBatch, TokenLayout
from jaxengine.models.config import ShortConvConfig
from jaxengine.models.conv_step import conv_step
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import linear
from jaxengine.models.mixer_state import StateArray
from jaxengine.models.token_steps import run_tokens


def short_conv_state(cfg: ShortConvConfig) -> tuple[StateArray, ...]:
    """The per-sequence state: the last `conv_kernel` columns of the gated input B * x."""
    return (StateArray("conv", (cfg.channels, cfg.conv_kernel), float32=False, split_axis=0),)


class ShortConvMixer(nnx.Module):
    """in_proj -> (B | C | x); y = C * conv(B * x), a depthwise causal conv (optional bias)
    continuing from each sequence's conv window; out_proj. No recurrence: the conv window is
    the whole state.

    `decode=True` is a decode or verify step (`token_steps.py`): each sequence advances by
    its few tokens with the one-token conv update."""

    def __init__(self, hidden_size: int, cfg: ShortConvConfig, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        del eps  # no norm inside the mixer
        self.cfg = cfg
        width = cfg.channels
        self.in_proj = linear(hidden_size, 3 * width, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(None, RECURRENT))
        self.conv_weight = param(jnp.zeros((width, cfg.conv_kernel), dtype), (RECURRENT, None))  # [D, K]
        if cfg.bias:
            self.conv_bias = param(jnp.zeros((width,), dtype), (RECURRENT,))
        self.out_proj = linear(width, hidden_size, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(RECURRENT, None))

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        initial: tuple[jax.Array],  # conv [S, D, K]
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
        decode: bool,
    ) -> tuple[jax.Array, tuple[jax.Array], tuple[jax.Array], tuple[jax.Array]]:
        """Returns out [T, D], the conv windows after this step [S, D, K], at the step's
        checkpoint saves [C, D, K] and at its draft positions [P, D, K]."""
        B, C, xs = jnp.split(self.in_proj(x), 3, axis=-1)
        gated = B * xs  # [T, D]: what the conv sees
        weight, bias = self.conv_weight[...], self.conv_bias[...] if self.cfg.bias else None
        if decode:

            def update(states, row):  # one token of each sequence
                (conv,) = states
                (gated_t,) = row
                out_t, conv = ops.causal_conv1d_update(gated_t, weight, bias, conv)
                return (out_t,), (conv,)

            (conv_out,), final, saved, at_drafts = run_tokens(update, initial, (gated,), batch, layout)
        else:
            conv_out, after, save_conv, conv_drafts = conv_step(ops, gated, weight, bias, initial[0], batch, layout)
            final, saved, at_drafts = (after,), (save_conv,), (conv_drafts,)
        return self.out_proj(C * conv_out), final, saved, at_drafts
