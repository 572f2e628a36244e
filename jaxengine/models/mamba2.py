"""The Mamba2 (SSD) mixer: its per-sequence state and its step."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import RECURRENT, param
from jaxengine.models.batch import StepBatch, TokenLayout, states_at_requests
from jaxengine.models.config import MambaConfig
from jaxengine.models.conv_step import conv_step
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import GatedRMSNorm, linear
from jaxengine.models.mixer_state import StateArray
from jaxengine.models.token_steps import run_tokens
from pallas_kernels.ssd import ssd_states_at


def mamba2_state(cfg: MambaConfig) -> tuple[StateArray, ...]:
    """The per-sequence state: the conv window over xBC and the SSM state (float32)."""
    return (
        StateArray("conv", (cfg.conv_dim, cfg.conv_kernel), float32=False, split_axis=0),
        StateArray("ssm", (cfg.num_heads, cfg.head_dim, cfg.state_size), float32=True, split_axis=0),
    )


class Mamba2Mixer(nnx.Module):
    """in_proj -> (z | xBC | dt); causal conv + SiLU on xBC; SSD scan from each sequence's
    state before the step; D skip; gate and norm (`MambaConfig.gated_norm`); out_proj.

    `decode=True` is a decode or verify step (`token_steps.py`): each sequence advances by
    its few tokens with the one-token conv and state updates instead of the chunked scan."""

    def __init__(self, hidden_size: int, cfg: MambaConfig, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        inner, heads = cfg.intermediate_size, cfg.num_heads
        self.in_proj = linear(
            hidden_size,
            inner + cfg.conv_dim + heads,
            bias=cfg.proj_bias,
            dtype=dtype,
            rngs=rngs,
            axes=(None, RECURRENT),
        )
        self.conv_weight = param(jnp.zeros((cfg.conv_dim, cfg.conv_kernel), dtype), (RECURRENT, None))  # [conv_dim, K]
        if cfg.conv_bias:
            self.conv_bias = param(jnp.zeros((cfg.conv_dim,), dtype), (RECURRENT,))
        self.dt_bias = param(jnp.zeros((heads,), dtype), (RECURRENT,))
        self.A_log = param(jnp.zeros((heads,), dtype), (RECURRENT,))
        self.D = param(jnp.zeros((heads,), dtype), (RECURRENT,))
        if cfg.gated_norm != "none":
            norm_eps = eps if cfg.norm_eps is None else cfg.norm_eps
            self.norm = GatedRMSNorm(
                inner, cfg.n_groups, norm_eps, dtype=dtype, norm_first=cfg.gated_norm == "norm_first", axis=RECURRENT
            )
        self.out_proj = linear(
            inner, hidden_size, bias=cfg.out_proj_bias, dtype=dtype, rngs=rngs, axes=(RECURRENT, None)
        )

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        initial: tuple[jax.Array, jax.Array],  # conv [S, conv_dim, K], SSM [S, H, P, N] float32
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
        decode: bool,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        """Returns out [T, D], the states after this step (conv [S, conv_dim, K], SSM
        [S, H, P, N] float32), at the step's checkpoint saves (conv [C, conv_dim, K], SSM
        [C, H, P, N] float32) and at its draft positions (the same with P rows)."""
        cfg = self.cfg
        num_tokens = x.shape[0]
        inner = cfg.intermediate_size
        z, xbc, dt = jnp.split(self.in_proj(x), [inner, inner + cfg.conv_dim], axis=-1)
        weight, bias = self.conv_weight[...], self.conv_bias[...] if cfg.conv_bias else None
        dt = jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        dt = jnp.clip(dt, *cfg.time_step_limit)
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))
        if decode:

            def update(states, row):  # one token of each sequence
                conv, ssm = states
                xbc_t, dt_t = row
                conv_t, conv = ops.causal_conv1d_update(xbc_t, weight, bias, conv)
                xs_t, B_t, C_t = self._split(jax.nn.silu(conv_t))
                y_t, ssm = ops.ssd_state_update(ssm, xs_t, dt_t, A, B_t, C_t)
                return (y_t, xs_t), (conv, ssm)

            (y, xs), final, saved, at_drafts = run_tokens(update, initial, (xbc, dt), batch, layout)
        else:
            conv_in, state_in = initial
            xbc, conv_out, save_conv, conv_drafts = conv_step(ops, xbc, weight, bias, conv_in, batch, layout)
            xs, B, C = self._split(jax.nn.silu(xbc))
            scan = ops.ragged_ssd_scan(
                xs, dt, A, B, C, state_in, batch.cu_q_lens, layout.start_pos, chunk_size=cfg.chunk_size
            )
            y, final = scan.y, (conv_out, scan.final_states)
            save_ssm, ssm_drafts = states_at_requests(
                lambda seq, pos, window: ssd_states_at(
                    xs, dt, A, B, state_in, batch.cu_q_lens, layout.start_pos, scan, seq, pos, window=window
                ),
                batch,
                ops.scan_row(cfg.chunk_size),
            )
            saved, at_drafts = (save_conv, save_ssm), (conv_drafts, ssm_drafts)

        y = y + self.D[...].astype(jnp.float32)[:, None] * xs.astype(jnp.float32)
        y = y.reshape(num_tokens, inner)
        if cfg.gated_norm == "none":
            y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
        else:
            y = self.norm(y, z).astype(x.dtype)  # norm in float32, like the reference
        return self.out_proj(y), final, (saved[0], saved[1].astype(jnp.float32)), at_drafts

    def _split(self, xbc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Activated xBC [N, conv_dim] -> x [N, H, P], B [N, G, N_state], C [N, G, N_state]."""
        cfg = self.cfg
        inner, gn = cfg.intermediate_size, cfg.n_groups * cfg.state_size
        xs, B, C = jnp.split(xbc, [inner, inner + gn], axis=-1)
        n = xbc.shape[0]
        return (
            xs.reshape(n, cfg.num_heads, cfg.head_dim),
            B.reshape(n, cfg.n_groups, cfg.state_size),
            C.reshape(n, cfg.n_groups, cfg.state_size),
        )
