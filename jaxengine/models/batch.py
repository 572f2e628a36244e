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

from pallas_kernels.ragged import token_segments


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Host-built integer arrays of one step; all plain index data."""

    input_ids: jax.Array  # [T] int32
    cu_q_lens: jax.Array  # [S + 1] int32: token offsets of the sequences
    kv_lens: jax.Array  # [S] int32: context length after this step (this step's tokens included)
    page_table: jax.Array  # [S, pages_per_seq] int32: KV pages of each sequence
    read_slots: jax.Array  # [S] int32: SSM slot each sequence's state is read from
    write_slots: jax.Array  # [S] int32: SSM slot its new state is written to
    # Checkpoints to store from inside the scan: the state of sequence `ckpt_seq[c]` after
    # absolute position `ckpt_pos[c]` (a chunk boundary) goes to SSM slot `ckpt_slot[c]`.
    ckpt_seq: jax.Array  # [C] int32
    ckpt_pos: jax.Array  # [C] int32 (-1 for padding)
    ckpt_slot: jax.Array  # [C] int32 (0, the null slot, for padding)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pools:
    """Device caches, donated to every step. One entry per attention or Mamba layer."""

    k_pages: tuple[jax.Array, ...]  # each [num_pages, page_size, kv_heads, head_dim]
    v_pages: tuple[jax.Array, ...]  # each [num_pages, page_size, kv_heads, head_dim]
    conv_states: tuple[jax.Array, ...]  # each [num_slots, conv_dim, conv_kernel]
    ssm_states: tuple[jax.Array, ...]  # each [num_slots, heads, head_dim, state_size] float32


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
