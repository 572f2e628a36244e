"""The acceptance rule: which drafts a verify step keeps. One definition (`num_accepted`),
used on the host (numpy, `accept`) and inside the step (jax.numpy, `last_accepted_rows`).

A speculating sequence's step verifies its drafts: its pending token and its `d` drafts go
through the target as one segment of `1 + d` tokens and the step samples a token after each.
Each row is sampled exactly as a plain decode step would sample that output position (same
settings, same per-request key), so a draft is kept with the probability the target gives it
and a rejection leaves the target's own draw: for drafts that are deterministic given the key
(ngram's; the MTP module's and draft model's, drawn with the target's noise) this is the
standard rejection rule, and seeded outputs are the same tokens with and without speculation.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.batch import StepBatch


def num_accepted(drafts, sampled, xp=np):
    """How many leading drafts the target agrees with: draft j is kept while the target's
    sample after the tokens before it (`sampled[..., j]`) equals it, and every draft before it
    was kept. drafts [..., d], sampled [..., >= d] -> [...]."""
    agree = sampled[..., : drafts.shape[-1]] == drafts
    return xp.sum(xp.cumprod(agree, axis=-1), axis=-1)


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verify step emits: the kept drafts, then the target's draw after them
    (after all drafts: its bonus token). `sampled[j]` is the target's token after the pending
    token and the first j drafts."""
    n = int(num_accepted(np.asarray(drafts, np.int64), np.asarray(sampled, np.int64))) if drafts else 0
    return drafts[:n] + [sampled[n]]


def last_accepted_rows(
    batch: StepBatch, sample_rows: jax.Array, num_drafts: jax.Array, sampled: jax.Array
) -> jax.Array:
    """Per sequence, the sample row (0..W-1) of its last accepted token, inside the step.
    A sequence's rows are its last W tokens: rows before its pending token (row W-1-d) are
    padding, counted as kept so the count is the row.

    sample_rows [S, W] flat token indices, num_drafts [S], sampled [S, W] -> [S] int32."""
    num_seqs, width = sampled.shape
    if width == 1:
        return jnp.zeros(num_seqs, jnp.int32)
    first = width - 1 - num_drafts  # [S]: the row of the pending token
    drafts = batch.input_ids[sample_rows[:, 1:]]  # [S, W - 1]: the token after each row
    before = jnp.arange(width - 1)[None, :] < first[:, None]
    drafts = jnp.where(before, sampled[:, :-1], drafts)  # padding agrees
    return num_accepted(drafts, sampled, jnp).astype(jnp.int32)
