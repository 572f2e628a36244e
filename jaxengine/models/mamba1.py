"""The Mamba-1 (selective scan) mixer, as Jamba uses it: its per-sequence state and its step."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import RECURRENT, param
from jaxengine.models.batch import StepBatch, TokenLayout, states_at_requests
from jaxengine.models.config import Mamba1Config
from jaxengine.models.conv_step import conv_step
from jaxengine.models.kernels import KernelOps
from jaxengine.models.layers import RMSNorm, linear
from jaxengine.models.mixer_state import StateArray
from jaxengine.models.token_steps import run_tokens
from pallas_kernels.selective_scan import selective_states_at


def mamba1_state(cfg: Mamba1Config) -> tuple[StateArray, ...]:
    """The per-sequence state: the conv window over x and the SSM state (float32), both per
    channel."""
    return (
        StateArray("conv", (cfg.intermediate_size, cfg.conv_kernel), float32=False, split_axis=0),
        StateArray("ssm", (cfg.intermediate_size, cfg.state_size), float32=True, split_axis=0),
    )


class Mamba1Mixer(nnx.Module):
    """in_proj -> (x | z); causal conv + SiLU on x; x_proj -> (dt | B | C), each RMS-normed
    with `bcdt_norms` (Jamba); dt = softplus(dt_proj(dt)); the selective scan from each
    sequence's state before the step; D skip; times silu(z); out_proj.

    `decode=True` is a decode or verify step (`token_steps.py`): each sequence advances by
    its few tokens with the one-token conv and state updates instead of the chunked scan."""

    def __init__(self, hidden_size: int, cfg: Mamba1Config, eps: float, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        inner, rank, n = cfg.intermediate_size, cfg.dt_rank, cfg.state_size
        self.in_proj = linear(
            hidden_size, 2 * inner, bias=cfg.proj_bias, dtype=dtype, rngs=rngs, axes=(None, RECURRENT)
        )
        self.conv_weight = param(jnp.zeros((inner, cfg.conv_kernel), dtype), (RECURRENT, None))  # [d, K]
        if cfg.conv_bias:
            self.conv_bias = param(jnp.zeros((inner,), dtype), (RECURRENT,))
        self.x_proj = linear(inner, rank + 2 * n, bias=False, dtype=dtype, rngs=rngs, axes=(RECURRENT, None))
        self.dt_proj = linear(rank, inner, bias=True, dtype=dtype, rngs=rngs, axes=(None, RECURRENT))
        self.A_log = param(jnp.zeros((inner, n), dtype), (RECURRENT, None))
        self.D = param(jnp.zeros((inner,), dtype), (RECURRENT,))
        if cfg.bcdt_norms:
            self.dt_norm = RMSNorm(rank, eps, dtype=dtype)
            self.b_norm = RMSNorm(n, eps, dtype=dtype)
            self.c_norm = RMSNorm(n, eps, dtype=dtype)
        self.out_proj = linear(inner, hidden_size, bias=cfg.proj_bias, dtype=dtype, rngs=rngs, axes=(RECURRENT, None))

    def __call__(
        self,
        x: jax.Array,  # [T, D]
        initial: tuple[jax.Array, jax.Array],  # conv [S, d, K], SSM [S, d, N] float32
        batch: StepBatch,
        layout: TokenLayout,
        ops: KernelOps,
        decode: bool,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
        """Returns out [T, D], the states after this step (conv [S, d, K], SSM [S, d, N]
        float32), at the step's checkpoint saves (conv [C, d, K], SSM [C, d, N] float32) and
        at its draft positions (the same with P rows)."""
        cfg = self.cfg
        xs, z = jnp.split(self.in_proj(x), 2, axis=-1)  # [T, d] each
        weight, bias = self.conv_weight[...], self.conv_bias[...] if cfg.conv_bias else None
        A = -jnp.exp(self.A_log[...].astype(jnp.float32))  # [d, N]
        if decode:

            def update(states, row):  # one token of each sequence
                conv, ssm = states
                (x_t,) = row
                conv_t, conv = ops.causal_conv1d_update(x_t, weight, bias, conv)
                u_t = jax.nn.silu(conv_t)
                dt_t, B_t, C_t = self._selection(u_t)
                y_t, ssm = ops.selective_state_update(ssm, u_t, dt_t, A, B_t, C_t)
                return (y_t, u_t), (conv, ssm)

            (y, u), final, saved, at_drafts = run_tokens(update, initial, (xs,), batch, layout)
        else:
            conv_in, state_in = initial
            conv_x, conv_out, save_conv, conv_drafts = conv_step(ops, xs, weight, bias, conv_in, batch, layout)
            u = jax.nn.silu(conv_x)
            dt, B, C = self._selection(u)
            scan = ops.ragged_selective_scan(
                u, dt, A, B, C, state_in, batch.cu_q_lens, layout.start_pos, chunk_size=cfg.chunk_size
            )
            y, final = scan.y, (conv_out, scan.final_states)
            save_ssm, ssm_drafts = states_at_requests(
                lambda seq, pos, window: selective_states_at(
                    u, dt, A, B, state_in, batch.cu_q_lens, layout.start_pos, scan, seq, pos, window=window
                ),
                batch,
                ops.scan_row(cfg.chunk_size),
            )
            saved, at_drafts = (save_conv, save_ssm), (conv_drafts, ssm_drafts)

        y = y + self.D[...].astype(jnp.float32) * u.astype(jnp.float32)
        y = (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
        return self.out_proj(y), final, (saved[0], saved[1].astype(jnp.float32)), at_drafts

    def _selection(self, u: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Activated conv output u [N, d] -> dt [N, d] float32 (softplus), B and C [N, N_state]."""
        cfg = self.cfg
        dt, B, C = jnp.split(self.x_proj(u), [cfg.dt_rank, cfg.dt_rank + cfg.state_size], axis=-1)
        if cfg.bcdt_norms:
            dt, B, C = self.dt_norm(dt), self.b_norm(B), self.c_norm(C)
        return jax.nn.softplus(self.dt_proj(dt).astype(jnp.float32)), B, C
