"""The Gated DeltaNet mixer (Qwen3-Next, Qwen3.5): its per-sequence state and its step."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import RECURRENT, param
from jaxengine.models.batch import StepBatch, TokenLayout, states_at_requests
from jaxengine.models.config import GatedDeltaConfig
from jaxengine.models.conv_step import conv_step
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import HeadNormThenGate, linear
from jaxengine.models.mixer_state import StateArray
from jaxengine.models.token_steps import run_tokens
from pallas_kernels.gated_delta import gated_delta_states_at

L2_EPS = 1e-6  # q and k are normalised as x / sqrt(sum(x^2) + eps)


def gated_delta_state(cfg: GatedDeltaConfig) -> tuple[StateArray, ...]:
    """The per-sequence state: the conv window over q | k | v and the delta-rule state (float32)."""
    return (
        StateArray("conv", (cfg.conv_dim, cfg.conv_kernel), float32=False, split_axis=0),
        StateArray(
            "recurrent", (cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim), float32=True, split_axis=0
        ),
    )


def _l2_normalise(x: jax.Array) -> jax.Array:  # [..., d] -> float32
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


class GatedDeltaMixer(nnx.Module):
    """in_proj -> (q | k | v | z | b | a); causal conv (no bias) + SiLU on q | k | v;
    L2-normalised q and k; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) per
    value head; the gated delta rule from each sequence's state before the step; per-head
    RMS norm then silu(z) gate; out_proj.

    `decode=True` is a decode or verify step (`token_steps.py`): each sequence advances by
    its few tokens with the one-token conv and delta-rule updates instead of the chunked scan."""

    def __init__(self, hidden_size: int, cfg: GatedDeltaConfig, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        heads = cfg.num_value_heads
        self.in_proj = linear(
            hidden_size, cfg.projection_size, bias=False, dtype=dtype, rngs=rngs, axes=(None, RECURRENT)
        )
        self.conv_weight = param(jnp.zeros((cfg.conv_dim, cfg.conv_kernel), dtype), (RECURRENT, None))  # [conv_dim, K]
        self.dt_bias = param(jnp.zeros((heads,), dtype), (RECURRENT,))
        self.A_log = param(jnp.zeros((heads,), dtype), (RECURRENT,))
        self.norm = HeadNormThenGate(cfg.value_head_dim, eps, dtype=dtype)
        self.out_proj = linear(cfg.value_dim, hidden_size, bias=False, dtype=dtype, rngs=rngs, axes=(RECURRENT, None))

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        initial: tuple[jax.Array, jax.Array],  # conv [S, conv_dim, K], recurrent [S, Hv, dk, dv] float32
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
        decode: bool,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        """Returns out [T, D], the states after this step, at the step's checkpoint saves
        (conv [C, conv_dim, K], recurrent [C, Hv, dk, dv] float32) and at its draft positions
        (the same with P rows)."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        heads, dk, dv = cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim
        qkv, z, b, a = jnp.split(
            self.in_proj(x), [cfg.conv_dim, cfg.conv_dim + cfg.value_dim, cfg.conv_dim + cfg.value_dim + heads], axis=-1
        )
        beta = jax.nn.sigmoid(b.astype(jnp.float32))  # [T, Hv]
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        )
        scale = dk**-0.5
        weight = self.conv_weight[...]
        if decode:

            def update(states, row):  # one token of each sequence
                conv, recurrent = states
                qkv_t, g_t, beta_t = row
                conv_t, conv = ops.causal_conv1d_update(qkv_t, weight, None, conv)
                q_t, k_t, v_t = self._split(jax.nn.silu(conv_t))
                o_t, recurrent = ops.gated_delta_update(recurrent, q_t, k_t, v_t, g_t, beta_t, scale=scale)
                return (o_t,), (conv, recurrent)

            (o,), final, saved, at_drafts = run_tokens(update, initial, (qkv, g, beta), batch, layout)
        else:
            conv_in, state_in = initial
            qkv, conv_out, save_conv, conv_drafts = conv_step(ops, qkv, weight, None, conv_in, batch, layout)
            q, k, v = self._split(jax.nn.silu(qkv))
            scan = ops.ragged_gated_delta(
                q, k, v, g, beta, state_in, batch.cu_q_lens, layout.start_pos, chunk_size=cfg.chunk_size, scale=scale
            )
            o, final = scan.o, (conv_out, scan.final_states)
            save_state, state_drafts = states_at_requests(
                lambda seq, pos, window: gated_delta_states_at(
                    k, v, g, beta, state_in, batch.cu_q_lens, layout.start_pos, scan, seq, pos, window=window
                ),
                batch,
                ops.scan_row(cfg.chunk_size),
            )
            saved, at_drafts = (save_conv, save_state), (conv_drafts, state_drafts)
        o = self.norm(o.astype(x.dtype), z.reshape(num_tokens, heads, dv))
        return self.out_proj(o.reshape(num_tokens, -1)), final, saved, at_drafts

    def _split(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Activated q | k | v [N, conv_dim] -> L2-normalised q, k [N, Hk, dk] float32, v [N, Hv, dv]."""
        cfg = self.cfg
        n = qkv.shape[0]
        q, k, v = jnp.split(qkv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
        q = _l2_normalise(q.reshape(n, cfg.num_key_heads, cfg.key_head_dim))
        k = _l2_normalise(k.reshape(n, cfg.num_key_heads, cfg.key_head_dim))
        return q, k, v.reshape(n, cfg.num_value_heads, cfg.value_head_dim)
