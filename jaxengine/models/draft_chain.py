"""A draft model run inside the target's step (speculative decoding's `draft_model` method).

The draft is a whole model of its own (any supported architecture with the target's
vocabulary) with pools of its own, laid out as the target's: its KV pages in cache blocks of
the same indices, so the target's page tables, prefix hits and checkpoint blocks serve it
too, and its recurrent states in live slots of the same indices. Every step with a sequence
that speculates runs it over the step's tokens, as the target, so every position such a
sequence computes has the draft's KV entry and state (a prefix hit brings the draft's with the
target's; nothing is recomputed for it). A step where no sequence speculates (the engine
admits requests without speculation where it does not pay) runs in a shape compiled without
it (`BatchBuilder`), or, in one with it while that compiles, skips it; the cache blocks those
steps fill are marked as lacking the draft's state, and a hit on them does not speculate.

Then, when some sequence may verify drafts next step, it drafts k tokens per sequence
after that sequence's last accepted token: k one-token steps of the draft, the first on the
step's own sample there (the target's next token), each next one on the draft just made,
each token chosen from the draft's logits by the engine's `choose` (as the target will draw).
These run on a copy of each sequence's draft state in a small pool of their own (the live
slots hold what the next step reads) and write KV entries past the accepted positions, which
the next step overwrites.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxengine.models.batch import Pools, StepBatch, token_layout
from jaxengine.models.conditional import if_in_place
from jaxengine.models.mtp import DraftChooser


def draft_model_drafts(
    draft,
    pools: Pools,
    batch: StepBatch,
    sample_rows: jax.Array,
    num_drafts: jax.Array,
    wants_drafts: jax.Array,
    speculates: jax.Array,
    sampled: jax.Array,
    last: jax.Array,
    choose: DraftChooser,
    num_speculative_tokens: int,
    decode: bool,
) -> tuple[jax.Array, Pools]:
    """Runs the draft model over the step's tokens when some sequence `speculates` [S] and,
    when some sequence `wants_drafts` [S] (only speculating ones do), drafts
    `num_speculative_tokens` tokens per sequence after its last accepted one, each picked by
    `choose` from the draft's logits.

    sample_rows [S, W] flat token indices, num_drafts [S], sampled [S, W]: the step's samples;
    last [S]: each sequence's last accepted sample row (`engine/spec/acceptance.py`).
    Returns drafts [S, k] int32 (zeros when none is wanted) and the draft's pools after the step."""

    def run(carry):  # the pass over the step's tokens, only when some sequence speculates
        pools, ids = carry
        return draft(pools, dataclasses.replace(batch, input_ids=ids), decode=decode, hidden=True)[1], ids * 0

    pools, _ = if_in_place(jnp.any(speculates), run, (pools, batch.input_ids))
    num_seqs = sampled.shape[0]
    page_size = pools.k_pages[0].shape[1] if pools.k_pages else 1
    row = jnp.take_along_axis(sample_rows, last[:, None], axis=1)[:, 0]  # [S] flat token index
    first_token = jnp.take_along_axis(sampled, last[:, None], axis=1)[:, 0]  # [S]: the target's next token
    start = token_layout(batch, page_size).positions[row] + 1  # [S]: its position
    capacity = batch.page_table.shape[1] * page_size
    seqs = jnp.arange(num_seqs, dtype=jnp.int32)
    mini = jnp.arange(1, num_seqs + 1, dtype=jnp.int32)  # sequence s's row of the small pool (row 0: null)
    chain = dataclasses.replace(
        batch,
        cu_q_lens=jnp.arange(num_seqs + 1, dtype=jnp.int32),
        read_slots=mini,
        write_slots=mini,
        restore_blocks=batch.restore_blocks[:, :0],
        save_seq=batch.save_seq[:0],
        save_pos=batch.save_pos[:0],
        save_blocks=batch.save_blocks[:0],
        state_seq=batch.state_seq[:0],
        state_pos=batch.state_pos[:0],
        state_slots=batch.state_slots[:0],
    )
    slots = _accepted_state_slots(batch, num_drafts, last, sampled.shape[1])  # [S]

    def one_token(i, carry):
        tokens, drafts, k_pages, v_pages, states = carry
        pos = jnp.minimum(start + i, capacity - 1)  # past the page table: drafts the host never uses
        step = dataclasses.replace(chain, input_ids=tokens, kv_lens=pos + 1)
        logits, out = draft(Pools(k_pages, v_pages, pools.checkpoints, states), step, decode=True)
        tokens = choose(logits, i)  # [S]
        return tokens, drafts.at[seqs, i].set(tokens), out.k_pages, out.v_pages, out.states

    def drafting(carry):  # only when some sequence drafts; `slots` comes in through the carry
        drafts, k_pages, v_pages, slots = carry  # so that gathering the small pool stays inside
        small = tuple(tuple(jnp.concatenate([a[:1], a[slots]]) for a in layer) for layer in pools.states)
        _, drafts, k_pages, v_pages, _ = jax.lax.fori_loop(
            0, num_speculative_tokens, one_token, (first_token, drafts, k_pages, v_pages, small)
        )
        return drafts, k_pages, v_pages, slots * 0

    drafts = jnp.zeros((num_seqs, num_speculative_tokens), jnp.int32)
    drafts, k_pages, v_pages, _ = if_in_place(
        jnp.any(wants_drafts), drafting, (drafts, pools.k_pages, pools.v_pages, slots)
    )
    return drafts, dataclasses.replace(pools, k_pages=k_pages, v_pages=v_pages)


def _accepted_state_slots(batch: StepBatch, num_drafts: jax.Array, last: jax.Array, width: int) -> jax.Array:
    """Per sequence, the live slot its state after the last accepted row is in [S]: its write
    slot when that is its last token, else the verify step's position slot for that row
    (after its pending token and j drafts: entry s * k + j, `StepBatch.state_slots`)."""
    num_seqs = batch.write_slots.shape[0]
    per_seq = batch.state_slots.shape[0] // num_seqs
    if not per_seq:
        return batch.write_slots
    j = last - (width - 1 - num_drafts)  # drafts accepted before it
    at = jnp.arange(num_seqs) * per_seq + jnp.minimum(j, per_seq - 1)
    return jnp.where(j < num_drafts, batch.state_slots[at], batch.write_slots)
