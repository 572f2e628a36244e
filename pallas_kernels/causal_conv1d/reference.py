"""Pure-jnp reference for Mamba2's depthwise causal conv1d with state.

A sequence's conv state holds its last K raw input columns (`[D, K]`, oldest first), the
convention of Hugging Face's Mamba2 cache. The output at a token is
`bias + sum_k weight[:, k] * column(token - (K - 1 - k))`, where columns before the
sequence's first token this step come from its conv state. No activation is applied.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.ragged import token_segments


def _column(
    x: jax.Array,  # [T, D]
    conv_states: jax.Array,  # [S, D, K]
    cu_seqlens: jax.Array,  # [S + 1] int32
    seq: jax.Array,  # [...] int32
    rel: jax.Array,  # [...] int32: column index within the sequence's tokens this step
) -> jax.Array:  # [..., D]
    """Input column `rel` of each sequence `seq` (negative: from its conv state)."""
    kernel = conv_states.shape[-1]
    from_x = x[jnp.clip(cu_seqlens[seq] + rel, 0, x.shape[0] - 1)]
    from_state = conv_states[seq, :, jnp.clip(kernel + rel, 0, kernel - 1)]
    return jnp.where((rel >= 0)[..., None], from_x, from_state)


def conv_states_after(
    x: jax.Array,  # [T, D] raw inputs
    conv_states: jax.Array,  # [S, D, K] last K columns before this step
    cu_seqlens: jax.Array,  # [S + 1] int32
    seq: jax.Array,  # [C] int32
    num_tokens: jax.Array,  # [C] int32: tokens of this step already consumed
) -> jax.Array:  # [C, D, K]
    """The conv state (last K raw columns) of sequence `seq[c]` after its first `num_tokens[c]`
    tokens of this step."""
    kernel = conv_states.shape[-1]
    cols = [_column(x, conv_states, cu_seqlens, seq, num_tokens - kernel + c) for c in range(kernel)]
    return jnp.stack(cols, axis=-1)


def ragged_causal_conv1d(
    x: jax.Array,  # [T, D] raw inputs
    weight: jax.Array,  # [D, K]
    bias: jax.Array | None,  # [D]
    conv_states: jax.Array,  # [S, D, K] last K columns before this step
    cu_seqlens: jax.Array,  # [S + 1] int32
) -> tuple[jax.Array, jax.Array]:  # out [T, D] (zero for padding), new states [S, D, K]
    """Convolves every sequence of a ragged batch, continuing from its conv state."""
    num_tokens, _ = x.shape
    kernel = weight.shape[1]
    _, local, valid = token_segments(cu_seqlens, num_tokens)
    seq_len = cu_seqlens[1:] - cu_seqlens[:-1]
    w = weight.astype(jnp.float32)
    f32_x = x.astype(jnp.float32)

    # Columns from this step's own tokens: tap k reads the token `shift` rows earlier, if that
    # is still the same sequence (a static shift, no gather).
    out = jnp.zeros(x.shape, jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32), x.shape)
    for k in range(kernel):
        shift = kernel - 1 - k
        earlier = jnp.concatenate([jnp.zeros((shift, x.shape[1]), jnp.float32), f32_x[: num_tokens - shift]])
        out = out + w[:, k] * jnp.where((local >= shift)[:, None], earlier, 0.0)
    # Columns from the conv state reach only each sequence's first K - 1 tokens: add them per
    # sequence, [S, D] at a time.
    states = conv_states.astype(jnp.float32)
    for pos in range(kernel - 1):
        taps = [k for k in range(kernel) if kernel - 1 - k > pos]  # taps that reach before the step
        from_state = sum(w[:, k] * states[:, :, kernel + pos - (kernel - 1 - k)] for k in taps)  # [S, D]
        token = jnp.where(pos < seq_len, cu_seqlens[:-1] + pos, num_tokens)  # dropped if too short
        out = out.at[token].add(from_state, mode="drop")
    out = jnp.where(valid[:, None], out, 0.0).astype(x.dtype)

    seqs = jnp.arange(conv_states.shape[0])
    new_states = conv_states_after(x, conv_states, cu_seqlens, seqs, seq_len).astype(conv_states.dtype)
    return out, new_states


def causal_conv1d_update(
    x: jax.Array,  # [S, D] one new column per sequence
    weight: jax.Array,  # [D, K]
    bias: jax.Array | None,  # [D]
    conv_state: jax.Array,  # [S, D, K]
) -> tuple[jax.Array, jax.Array]:  # out [S, D], new state [S, D, K]
    """Advances each sequence's conv by one token (the decode step)."""
    window = jnp.concatenate([conv_state[:, :, 1:], x[:, :, None].astype(conv_state.dtype)], axis=-1)
    out = jnp.einsum("sdk,dk->sd", window.astype(jnp.float32), weight.astype(jnp.float32))
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(x.dtype), window
