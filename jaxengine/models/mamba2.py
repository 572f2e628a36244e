"""The Mamba2 (SSD) mixer over the SSM state pool."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.batch import StepBatch, TokenLayout
from jaxengine.models.config import MambaConfig
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import GatedRMSNorm, linear
from pallas_kernels.causal_conv1d import conv_states_after
from pallas_kernels.ssd import ssd_states_at


def _initial(
    pool: jax.Array, slots: jax.Array, fresh: jax.Array, hit: jax.Array | None, restored: jax.Array | None
) -> jax.Array:
    """Each sequence's state before this step: its prefix hit's checkpoint where it has one,
    else its read slot's; zeros where it starts at position 0."""
    rows = _read_slots(pool, slots)
    if hit is not None:
        rows = jnp.where(hit.reshape(-1, *[1] * (pool.ndim - 1)), restored.astype(pool.dtype), rows)
    return jnp.where(fresh.reshape(-1, *[1] * (pool.ndim - 1)), 0, rows)


def _read_slots(pool: jax.Array, slots: jax.Array) -> jax.Array:
    """Each sequence's state from its read slot.

    With a single sequence the gather takes one extra row (the null slot 0) that is dropped
    again: with a single index XLA turns the gather into a dynamic slice and fuses copies of
    it into every consumer, some of which may run after the pool's in-place scatter, so it
    copies the whole pool (twice) on every one-sequence step instead."""
    if slots.shape[0] == 1:
        rows = pool[jnp.concatenate([slots, jnp.zeros((1,), slots.dtype)])][:1]  # [1, ...]
    else:
        rows = pool[slots]  # [S, ...]
    return rows


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
        restored: tuple[jax.Array, jax.Array] | None,  # conv [S, conv_dim, K], SSM [S, H, P, N] of hits
    ) -> tuple[jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array]]:
        """Returns out [T, D], the new live pools, and the states to save: conv
        [C, conv_dim, K] and SSM [C, H, P, N] float32 after each `batch.save_pos`."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        inner, gn = cfg.intermediate_size, cfg.n_groups * cfg.state_size
        z, xbc, dt = jnp.split(self.in_proj(x), [inner, inner + cfg.conv_dim], axis=-1)

        bias = self.conv_bias[...] if cfg.conv_bias else None
        # A sequence whose first token this step is position 0 starts from zero states,
        # whatever its read slot last held; one that resumes from a prefix hit reads the
        # checkpoint instead of its read slot.
        fresh = layout.start_pos == 0  # [S]
        hit = batch.restore_blocks[:, 0] > 0 if restored is not None else None  # [S]
        conv_in = _initial(conv_pool, batch.read_slots, fresh, hit, restored and restored[0])  # [S, conv_dim, K]
        if decode:
            xbc, conv_out = ops.causal_conv1d_update(xbc, self.conv_weight[...], bias, conv_in)
            save_conv = conv_out[batch.save_seq]
        else:
            xbc_raw = xbc
            xbc, conv_out = ops.ragged_causal_conv1d(xbc, self.conv_weight[...], bias, conv_in, batch.cu_q_lens)
            consumed = batch.save_pos - layout.start_pos[batch.save_seq]  # tokens of this step before it
            save_conv = conv_states_after(xbc_raw, conv_in, batch.cu_q_lens, batch.save_seq, consumed)
        conv_pool = conv_pool.at[batch.write_slots].set(conv_out.astype(conv_pool.dtype))
        xbc = jax.nn.silu(xbc)
        xs, B, C = jnp.split(xbc, [inner, inner + gn], axis=-1)
        xs = xs.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        B = B.reshape(num_tokens, cfg.n_groups, cfg.state_size)
        C = C.reshape(num_tokens, cfg.n_groups, cfg.state_size)

        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, *cfg.time_step_limit)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        state_in = _initial(ssm_pool, batch.read_slots, fresh, hit, restored and restored[1])  # [S, H, P, N]
        if decode:
            y, state_out = ops.ssd_state_update(state_in, xs, dt, A, B, C)
            save_ssm = state_out[batch.save_seq]
        else:
            scan = ops.ragged_ssd_scan(
                xs, dt, A, B, C, state_in, batch.cu_q_lens, layout.start_pos, chunk_size=cfg.chunk_size
            )
            y, state_out = scan.y, scan.final_states
            save_ssm = ssd_states_at(
                xs, dt, A, B, state_in, batch.cu_q_lens, layout.start_pos, scan, batch.save_seq, batch.save_pos,
                window=ops.scan_row(cfg.chunk_size),
            )
        ssm_pool = ssm_pool.at[batch.write_slots].set(state_out.astype(ssm_pool.dtype))

        y = y + self.D[...].astype(jnp.float32)[:, None] * xs.astype(jnp.float32)
        y = self.norm(y.reshape(num_tokens, inner), z).astype(x.dtype)  # norm in float32, like the reference
        return self.out_proj(y), conv_pool, ssm_pool, (save_conv, save_ssm.astype(jnp.float32))
