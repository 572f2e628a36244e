"""The per-step inputs of the model: one ragged batch and the device pools it reads and writes.

Tokens of every scheduled sequence lie on one flat axis padded to a token bucket `T`;
per-sequence arrays are padded to a sequence bucket `S` (padded sequences have zero tokens
and read and write slot 0). Index 0 of every pool is a null sink: padding writes there and
nothing real reads it.
"""

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxengine.models.conditional import when
from pallas_kernels.ragged import token_segments


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Host-built integer arrays of one step; all plain index data."""

    input_ids: jax.Array  # [T] int32
    cu_q_lens: jax.Array  # [S + 1] int32: token offsets of the sequences
    kv_lens: jax.Array  # [S] int32: context length after this step (this step's tokens included)
    page_table: jax.Array  # [S, pages_per_seq] int32: KV pages of each sequence
    read_slots: jax.Array  # [S] int32: live state slot each sequence's state is read from
    write_slots: jax.Array  # [S] int32: live state slot its new state is written to
    # A prefix hit: the sequence's state is read from the checkpoint in these cache blocks
    # instead of its read slot (block 0, the null block, in the first column: no hit).
    restore_blocks: jax.Array  # [S, blocks_per_checkpoint] int32
    # Checkpoints to store: the state of sequence `save_seq[c]` after absolute position
    # `save_pos[c]` (a page boundary this step reaches) goes to cache blocks `save_blocks[c]`.
    save_seq: jax.Array  # [C] int32
    save_pos: jax.Array  # [C] int32 (-1 for padding)
    save_blocks: jax.Array  # [C, blocks_per_checkpoint] int32 (the null block 0 for padding)
    # Speculation: the state of sequence `state_seq[p]` after absolute position
    # `state_pos[p]` (its pending token or a draft) goes to live slot `state_slots[p]`;
    # entry s * k + j (k = P / S) is sequence s's after its pending token and j drafts.
    state_seq: jax.Array  # [P] int32
    state_pos: jax.Array  # [P] int32 (-1 for padding)
    state_slots: jax.Array  # [P] int32 (the null slot 0 for padding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pools:
    """Device caches, donated to every step.

    The cache blocks are the KV page arrays: a block is one page of each (KV pages and
    recurrent-state checkpoints share them, see `checkpoint_store.py`); a model without
    attention layers keeps its checkpoints in `checkpoints` instead. The live state slots of
    running sequences are separate: per recurrent layer, one array per state array its mixer
    declares (`mixer_state.py`)."""

    k_pages: tuple[jax.Array, ...]  # each [num_blocks, page_size, kv_heads, head_dim]
    v_pages: tuple[jax.Array, ...]  # each [num_blocks, page_size, kv_heads, head_dim]
    checkpoints: tuple[jax.Array, ...]  # () or ([num_blocks, layer_state_elems],) without attention layers
    states: tuple[tuple[jax.Array, ...], ...]  # per recurrent layer, each [num_slots, *declared shape]

    def store_arrays(self) -> list[jax.Array]:
        """The arrays checkpoints are stored in: k0, v0, k1, v1, ... (or `checkpoints`)."""
        if self.k_pages:
            return [a for kv in zip(self.k_pages, self.v_pages) for a in kv]
        return list(self.checkpoints)

    def with_store(self, arrays: list[jax.Array], states: tuple[tuple[jax.Array, ...], ...]) -> "Pools":
        if self.k_pages:
            return Pools(tuple(arrays[0::2]), tuple(arrays[1::2]), (), states)
        return Pools((), (), tuple(arrays), states)


class TokenLayout(NamedTuple):
    """Per-token facts derived on device from a `StepBatch` once per step."""

    seq: jax.Array  # [T] int32: sequence of each token (clipped for padding)
    valid: jax.Array  # [T] bool: real token, not padding
    positions: jax.Array  # [T] int32: absolute position (0 for padding)
    slot_mapping: jax.Array  # [T] int32: flat KV slot page * page_size + offset (0 for padding)
    start_pos: jax.Array  # [S] int32: absolute position of each sequence's first token this step


def token_layout(batch: StepBatch, page_size: int) -> TokenLayout:
    """Derives positions and KV write slots of every token from the batch's index arrays."""
    num_tokens = batch.input_ids.shape[0]
    seq, local, valid = token_segments(batch.cu_q_lens, num_tokens)
    q_lens = batch.cu_q_lens[1:] - batch.cu_q_lens[:-1]
    start_pos = batch.kv_lens - q_lens
    positions = jnp.where(valid, start_pos[seq] + local, 0)
    page = batch.page_table[seq, positions // page_size]
    slot_mapping = jnp.where(valid, page * page_size + positions % page_size, 0)
    return TokenLayout(seq, valid, positions, slot_mapping, start_pos)


def states_at_requests(states_at, batch: StepBatch, window: int) -> tuple[jax.Array, jax.Array]:
    """A mixed step's states at its state requests: `states_at(seq, pos, window)` for the
    checkpoint saves ([C, ...]; `window`: the scan's row length) and for the draft positions
    of the sequences it verifies ([P, ...]). Those lie at most k + 1 tokens into their
    sequence's segment (k = P / S, the drafts per sequence), so a window of k + 1 covers them;
    they are computed only when some sequence verifies drafts (a mixed step of a speculating
    engine mostly verifies none: prefill chunks, or speculation turned off), else zeros (for
    the null slot)."""
    saves = states_at(batch.save_seq, batch.save_pos, window)
    short = min(window, batch.state_seq.shape[0] // batch.kv_lens.shape[0] + 1)

    def at_drafts():
        return states_at(batch.state_seq, batch.state_pos, short)

    if not batch.state_seq.shape[0]:
        return saves, at_drafts()  # [0, ...]
    return saves, when(jnp.any(batch.state_pos >= 0), at_drafts)
