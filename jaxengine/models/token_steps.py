"""A recurrent mixer's decode step: each sequence advances from its live state by its few
tokens of this step, one token at a time, with the mixer's one-token update.

A decode step has `w = T // S` token rows per sequence: `w == 1` is a plain decode step
(token s belongs to sequence s), `w == k + 1` a verify step of speculative decoding (each
sequence's pending token and up to k drafts, laid out ragged: sequence s's tokens start at
`cu_q_lens[s]`). Running the one-token update w times costs w small updates instead of a
chunked scan over the batch, and yields the state after every position for free: the
checkpoints the step stores and the draft positions' states are picked from them.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxengine.models.batch import StepBatch, TokenLayout

# update(states before a token: tuple of [S, *shape], inputs at that token: tuple of [S, ...])
#     -> (outputs at that token: tuple of [S, ...], states after it)
OneTokenUpdate = Callable[[tuple, tuple], tuple[tuple, tuple]]


def run_tokens(
    update: OneTokenUpdate,
    initial: tuple[jax.Array, ...],  # each [S, *shape]
    inputs: tuple[jax.Array, ...],  # each [T, ...]
    batch: StepBatch,
    layout: TokenLayout,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Returns the outputs at every token (each [T, ...]), each sequence's states after its
    last token (each [S, *shape]), and the states at the step's checkpoint saves (each
    [C, *shape]) and at its draft positions (each [P, *shape])."""
    num_tokens, num_seqs = batch.input_ids.shape[0], batch.kv_lens.shape[0]
    width = num_tokens // num_seqs
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]  # [S]
    if width == 1:  # token s is sequence s's
        rows = [tuple(inputs)]
    else:
        if num_seqs == 1:  # its tokens start at 0: with a constant index XLA slices the rows instead of
            index = jnp.arange(width)[None]  # fusing a dynamic slice into every state element it computes
        else:
            index = jnp.clip(batch.cu_q_lens[:-1, None] + jnp.arange(width), 0, num_tokens - 1)  # [S, w]
        rows = [tuple(a[index[:, j]] for a in inputs) for j in range(width)]
    states, outs, after = tuple(initial), [], []
    for j, row in enumerate(rows):
        out, new = update(states, row)
        if j:  # every sequence has row 0 (padding ones write to the null slot): only later rows may be past its end
            live = j < q_lens  # [S]: the sequence has a token at row j
            new = tuple(
                jnp.where(live.reshape((-1,) + (1,) * (n.ndim - 1)), n.astype(s.dtype), s) for n, s in zip(new, states)
            )
        states = tuple(n.astype(s.dtype) for n, s in zip(new, states))
        outs.append(out)
        after.append(states)

    if width == 1:
        return outs[0], states, tuple(s[batch.save_seq] for s in states), tuple(s[:0] for s in states)  # no drafts
    local = jnp.clip(layout.positions - layout.start_pos[layout.seq], 0, width - 1)  # [T]: row of each token
    outputs = tuple(jnp.stack(o, axis=1)[layout.seq, local] for o in zip(*outs))  # [S, w, ...] -> [T, ...]
    # A checkpoint save picks the state after its position from the w candidates.
    save_row = batch.save_pos - layout.start_pos[batch.save_seq] - 1  # [C]
    saves = []
    for i, final in enumerate(states):
        picked = final[batch.save_seq]
        for j in range(width - 1):
            hit = (save_row == j).reshape((-1,) + (1,) * (final.ndim - 1))
            picked = jnp.where(hit, after[j][i][batch.save_seq], picked)
        saves.append(picked)
    # Draft position p = s * k + j is sequence s's state after its pending token and j drafts.
    k = batch.state_seq.shape[0] // num_seqs
    at_drafts = tuple(
        jnp.stack([after[j][i] for j in range(k)], axis=1).reshape(-1, *s.shape[1:]) if k else s[:0]
        for i, s in enumerate(states)
    )
    return outputs, states, tuple(saves), at_drafts
