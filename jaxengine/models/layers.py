"""Layers shared by every architecture: norms, rotary embeddings, MLPs and mixtures of experts."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.axes import EXPERT_MLP, EXPERTS, MLP, linear_metadata, param
from jaxengine.models.config import MlpConfig, ModelConfig, MoeConfig


def linear(
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    dtype: jnp.dtype,
    rngs: nnx.Rngs,
    axes: tuple[str | None, str | None] = (None, None),
) -> nnx.Linear:
    """A dense layer whose kernel is `[in, out]` (Hugging Face stores `[out, in]`); `axes`:
    the logical axes of its input and output features (`axes.py`; None: replicated)."""
    return nnx.Linear(
        in_features, out_features, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs, **linear_metadata(*axes)
    )


def norm_settings(cfg: ModelConfig, dtype: jnp.dtype) -> dict:
    """The keyword arguments of the model's residual-stream RMS norms."""
    return dict(
        eps=cfg.rms_norm_eps, dtype=dtype, weight_in_fp32=cfg.norm_weight_in_fp32, weight_offset=cfg.norm_weight_offset
    )


class RMSNorm(nnx.Module):
    """RMS norm computed in float32 over the last axis. `weight_in_fp32` scales before casting
    back (Nemotron-H) instead of after (Llama and most others); `weight_offset=1` scales by
    `1 + weight` (zero-centred weights, Qwen3-Next and Qwen3.5), in float32 too."""

    def __init__(
        self, size: int, eps: float, *, dtype: jnp.dtype, weight_in_fp32: bool = False, weight_offset: float = 0.0
    ):
        self.weight = nnx.Param(jnp.full((size,), 1.0 - weight_offset, dtype))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32 or weight_offset != 0.0
        self.weight_offset = weight_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.weight_in_fp32:
            return ((self.weight[...].astype(jnp.float32) + self.weight_offset) * normed).astype(x.dtype)
        return self.weight[...] * normed.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Mamba2's output norm, RMS over each of `groups` groups: gate first (`y * silu(z)`,
    then the norm; Mamba2, Bamba) or, with `norm_first`, the norm then the gate (Falcon-H1's
    `mamba_norm_before_gate`, in float32 throughout as its reference computes it)."""

    def __init__(
        self, size: int, groups: int, eps: float, *, dtype: jnp.dtype, norm_first: bool = False, axis: str | None = None
    ):
        self.weight = param(jnp.ones((size,), dtype), (axis,))
        self.groups = groups
        self.eps = eps
        self.norm_first = norm_first

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:  # [T, I], [T, I] -> [T, I]
        dtype = y.dtype
        gate = jax.nn.silu(z.astype(jnp.float32))
        h = y.astype(jnp.float32) if self.norm_first else y.astype(jnp.float32) * gate
        g = h.reshape(*h.shape[:-1], self.groups, -1)
        normed = (g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.eps)).reshape(h.shape)
        if self.norm_first:
            return (self.weight[...].astype(jnp.float32) * normed * gate).astype(dtype)
        return self.weight[...] * normed.astype(dtype)


class HeadNormThenGate(nnx.Module):
    """Gated DeltaNet's output norm: RMS over each head's channels first, then times
    silu(gate) (the reverse of Mamba2's `GatedRMSNorm`); one weight shared by the heads."""

    def __init__(self, size: int, eps: float, *, dtype: jnp.dtype):
        self.weight = nnx.Param(jnp.ones((size,), dtype))
        self.eps = eps

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:  # [T, H, d], [T, H, d] -> [T, H, d]
        y32 = y.astype(jnp.float32)
        normed = (y32 * jax.lax.rsqrt(jnp.mean(y32 * y32, axis=-1, keepdims=True) + self.eps)).astype(y.dtype)
        return (self.weight[...] * normed * jax.nn.silu(z.astype(jnp.float32))).astype(y.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, rotary_dim: int, theta: float) -> jax.Array:
    """Rotates the first `rotary_dim` channels of each head (rotate-half style).

    x: [T, heads, head_dim]; positions: [T] int32."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, rotary_dim / 2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos = jnp.cos(emb).astype(x.dtype)[:, None, :]
    sin = jnp.sin(emb).astype(x.dtype)[:, None, :]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated * sin, rest], axis=-1)


def activation(name: str, x: jax.Array) -> jax.Array:
    """The MLP nonlinearities the supported models use."""
    if name == "silu":
        return jax.nn.silu(x)
    if name == "relu2":
        return jnp.square(jax.nn.relu(x))
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unsupported activation {name!r}; supported: silu, relu2, gelu")


class Mlp(nnx.Module):
    """Dense feed-forward: `down(act(gate(x)) * up(x))` when gated, else `down(act(up(x)))`."""

    def __init__(self, hidden_size: int, cfg: MlpConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        if cfg.gated:
            self.gate_proj = linear(
                hidden_size, cfg.intermediate_size, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(None, MLP)
            )
        self.up_proj = linear(
            hidden_size, cfg.intermediate_size, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(None, MLP)
        )
        self.down_proj = linear(
            cfg.intermediate_size, hidden_size, bias=cfg.bias, dtype=dtype, rngs=rngs, axes=(MLP, None)
        )

    def __call__(self, x: jax.Array, gate_up_delta: jax.Array | None = None) -> jax.Array:  # [T, D] -> [T, D]
        """`gate_up_delta` [T, 2 * I], when given, is added to the gate | up projections (a
        low-rank adapter's output, `shared_block.py`)."""
        up = self.up_proj(x)
        gate = self.gate_proj(x) if self.cfg.gated else None
        if gate_up_delta is not None:
            gate_delta, up_delta = jnp.split(gate_up_delta, 2, axis=-1)
            gate, up = gate + gate_delta, up + up_delta
        if self.cfg.gated:
            h = activation(self.cfg.activation, gate) * up
        else:
            h = activation(self.cfg.activation, up)
        return self.down_proj(h)


class Moe(nnx.Module):
    """Routed experts plus, where the model has one, a shared expert, evaluated densely over
    all experts.

    Every expert runs on every token and a `[T, E]` combine matrix (zero for experts not
    chosen) mixes them: simple and exact; a grouped-matmul kernel can replace it later."""

    def __init__(self, hidden_size: int, cfg: MoeConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        e, inner = cfg.num_experts, cfg.expert.intermediate_size
        up_width = 2 * inner if cfg.expert.gated else inner
        router_dtype = jnp.float32 if cfg.router == "sigmoid_grouped" else dtype
        self.router = nnx.Param(jnp.zeros((hidden_size, e), router_dtype))  # [D, E]
        if cfg.router == "sigmoid_grouped":
            self.router_bias = nnx.Param(jnp.zeros((e,), jnp.float32))  # selection-only correction
        self.experts_up = param(jnp.zeros((e, hidden_size, up_width), dtype), (EXPERTS, None, EXPERT_MLP))  # gate | up
        self.experts_down = param(jnp.zeros((e, inner, hidden_size), dtype), (EXPERTS, EXPERT_MLP, None))
        if cfg.shared is not None:
            self.shared = Mlp(hidden_size, cfg.shared, dtype=dtype, rngs=rngs)
        if cfg.shared_gate:
            self.shared_gate = nnx.Param(jnp.zeros((hidden_size, 1), dtype))  # [D, 1]

    def _combine_weights(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, E] float32
        cfg = self.cfg
        logits = x.astype(jnp.float32) @ self.router[...].astype(jnp.float32)
        if cfg.router == "softmax_topk":
            top_vals, top_idx = jax.lax.top_k(logits, cfg.top_k)
            weights = jax.nn.softmax(top_vals, axis=-1)
        elif cfg.router == "softmax":
            weights, top_idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.top_k)
            if cfg.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdims=True)
        else:
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.router_bias[...]
            num_tokens, e = choice.shape
            grouped = choice.reshape(num_tokens, cfg.n_group, e // cfg.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, n_group]
            _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
            group_mask = (
                jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(num_tokens)[:, None], top_groups].set(True)
            )
            expert_mask = jnp.repeat(group_mask, e // cfg.n_group, axis=-1)
            _, top_idx = jax.lax.top_k(jnp.where(expert_mask, choice, -jnp.inf), cfg.top_k)
            weights = jnp.take_along_axis(scores, top_idx, axis=-1)
            if cfg.norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
            weights = weights * cfg.routed_scaling_factor
        weights = weights.astype(x.dtype).astype(jnp.float32)
        rows = jnp.arange(x.shape[0])[:, None]
        return jnp.zeros(logits.shape, jnp.float32).at[rows, top_idx].add(weights)

    def __call__(self, x: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        combine = self._combine_weights(x)
        up = jnp.einsum("td,edf->tef", x, self.experts_up[...])
        if self.cfg.expert.gated:
            gate, up = jnp.split(up, 2, axis=-1)
            h = activation(self.cfg.expert.activation, gate) * up
        else:
            h = activation(self.cfg.expert.activation, up)
        out = jnp.einsum("tef,efd->ted", h, self.experts_down[...]).astype(jnp.float32)
        routed = jnp.einsum("ted,te->td", out, combine).astype(x.dtype)  # experts summed in float32
        if self.cfg.shared is None:
            return routed
        shared = self.shared(x)
        if self.cfg.shared_gate:
            shared = jax.nn.sigmoid(x @ self.shared_gate[...]) * shared
        return routed + shared
