"""The Mamba2 (SSD) mixer over the SSM state pool."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.batch import StepBatch, TokenLayout
from jaxengine.models.config import MambaConfig
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import GatedRMSNorm, linear
from pallas_kernels.causal_conv1d import conv_states_after


def _read_slots(pool: jax.Array, slots: jax.Array, fresh: jax.Array) -> jax.Array:
    """Each sequence's state from its read slot; zeros where it starts at position 0.

    With a single sequence the gather takes one extra row (the null slot 0) that is dropped
    again: with a single index XLA turns the gather into a dynamic slice and fuses copies of
    it into every consumer, some of which may run after the pool's in-place scatter, so it
    copies the whole pool (twice) on every one-sequence step instead."""
    if slots.shape[0] == 1:
        rows = pool[jnp.concatenate([slots, jnp.zeros((1,), slots.dtype)])][:1]  # [1, ...]
    else:
        rows = pool[slots]  # [S, ...]
    return jnp.where(fresh.reshape(-1, *[1] * (pool.ndim - 1)), 0, rows)


class Mamba2Mixer(nnx.Module):
    """in_proj -> (z | xBC | dt); causal conv + SiLU on xBC; SSD scan from each sequence's
    read slot, final state to its write slot; D skip; gated norm; out_proj.

    `decode=True` is the one-token-per-sequence step (token s belongs to sequence s), which
    uses the single-token conv and state updates instead of the chunked scan."""

    def __init__(self, hidden_size: int, cfg: MambaConfig, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        inner, heads = cfg.intermediate_size, cfg.num_heads
        self.in_proj = linear(hidden_size, inner + cfg.conv_dim + heads, bias=cfg.proj_bias, dtype=dtype, rngs=rngs)
        self.conv_weight = nnx.Param(jnp.zeros((cfg.conv_dim, cfg.conv_kernel), dtype))  # [conv_dim, K]
        if cfg.conv_bias:
            self.conv_bias = nnx.Param(jnp.zeros((cfg.conv_dim,), dtype))
        self.dt_bias = nnx.Param(jnp.zeros((heads,), dtype))
        self.A_log = nnx.Param(jnp.zeros((heads,), dtype))
        self.D = nnx.Param(jnp.zeros((heads,), dtype))
        self.norm = GatedRMSNorm(inner, cfg.n_groups, eps, dtype=dtype)
        self.out_proj = linear(inner, hidden_size, bias=cfg.proj_bias, dtype=dtype, rngs=rngs)

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        conv_pool: jax.Array,  # [num_slots, conv_dim, K]
        ssm_pool: jax.Array,  # [num_slots, H, P, N] float32
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
        decode: bool,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [T, D], new conv_pool, new ssm_pool
        cfg = self.cfg
        num_tokens = x.shape[0]
        inner, gn = cfg.intermediate_size, cfg.n_groups * cfg.state_size
        z, xbc, dt = jnp.split(self.in_proj(x), [inner, inner + cfg.conv_dim], axis=-1)

        bias = self.conv_bias[...] if cfg.conv_bias else None
        # A sequence whose first token this step is position 0 starts from zero states,
        # whatever its read slot last held.
        fresh = layout.start_pos == 0  # [S]
        conv_in = _read_slots(conv_pool, batch.read_slots, fresh)  # [S, conv_dim, K]
        if batch.ckpt_slot.shape[0]:
            consumed = batch.ckpt_pos - layout.start_pos[batch.ckpt_seq]  # tokens of this step before it
            ckpt_conv = conv_states_after(xbc, conv_in, batch.cu_q_lens, batch.ckpt_seq, consumed)
            conv_pool = conv_pool.at[batch.ckpt_slot].set(ckpt_conv.astype(conv_pool.dtype))
        if decode:
            xbc, conv_out = ops.causal_conv1d_update(xbc, self.conv_weight[...], bias, conv_in)
        else:
            xbc, conv_out = ops.ragged_causal_conv1d(xbc, self.conv_weight[...], bias, conv_in, batch.cu_q_lens)
        conv_pool = conv_pool.at[batch.write_slots].set(conv_out.astype(conv_pool.dtype))
        xbc = jax.nn.silu(xbc)
        xs, B, C = jnp.split(xbc, [inner, inner + gn], axis=-1)
        xs = xs.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        B = B.reshape(num_tokens, cfg.n_groups, cfg.state_size)
        C = C.reshape(num_tokens, cfg.n_groups, cfg.state_size)

        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, *cfg.time_step_limit)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        state_in = _read_slots(ssm_pool, batch.read_slots, fresh)  # [S, H, P, N]
        if decode:
            y, state_out = ops.ssd_state_update(state_in, xs, dt, A, B, C)
        else:
            scan = ops.ragged_ssd_scan(
                xs, dt, A, B, C, state_in, batch.cu_q_lens, layout.start_pos, chunk_size=cfg.chunk_size
            )
            y, state_out = scan.y, scan.final_states
            if batch.ckpt_slot.shape[0]:
                # The row whose chunk ends at the checkpoint's position holds its state.
                match = (scan.chunk_seq[None, :] == batch.ckpt_seq[:, None]) & (
                    scan.chunk_end[None, :] == batch.ckpt_pos[:, None]
                )
                ckpt_states = scan.chunk_states[jnp.argmax(match, axis=1)]  # [C, H, P, N]
                ssm_pool = ssm_pool.at[batch.ckpt_slot].set(ckpt_states.astype(ssm_pool.dtype))
        ssm_pool = ssm_pool.at[batch.write_slots].set(state_out.astype(ssm_pool.dtype))

        y = y + self.D[...].astype(jnp.float32)[:, None] * xs.astype(jnp.float32)
        y = self.norm(y.reshape(num_tokens, inner), z).astype(x.dtype)  # norm in float32, like the reference
        return self.out_proj(y), conv_pool, ssm_pool

