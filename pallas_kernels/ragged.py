"""Helpers shared by the ragged references: mapping flat tokens to their sequences.

A ragged batch puts the tokens of all sequences on one flat axis; `cu_seqlens[s]` is the
offset of sequence `s` and `cu_seqlens[s + 1] - cu_seqlens[s]` its length this step.
Padded sequences have length zero; tokens at or past `cu_seqlens[-1]` are padding.
"""

import jax
import jax.numpy as jnp


def token_segments(cu_seqlens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns, for each flat token, its sequence index, its index within that
    sequence, and whether it is a real token (not padding).

    cu_seqlens: [S + 1] int32.  Returns three [num_tokens] arrays (int32, int32, bool).
    Padding tokens get sequence index S - 1 clipped into range and `valid == False`.
    """
    num_seqs = cu_seqlens.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens, t, side="right").astype(jnp.int32) - 1
    valid = seq < num_seqs
    seq = jnp.clip(seq, 0, num_seqs - 1)
    local = t - cu_seqlens[seq]
    return seq, local, valid
