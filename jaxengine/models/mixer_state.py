"""What a recurrent mixer keeps per sequence, as it declares it, and the slot reads around its step.

A recurrent mixer type (Mamba2, Gated DeltaNet, ...) declares its per-sequence state as a
tuple of `StateArray`s. Everything else is derived from the declarations: the live state
pools (one `[num_slots, *shape]` array per declared array and layer, `engine/pools.py`), the
checkpoints in the cache blocks (`checkpoint_store.py`), byte accounting
(`engine_config.py`, the replay tool) and the slot gathers and scatters of a step
(`initial_states`, `written_pools` below). The mixer's step itself only sees each
sequence's states before the step and returns them after it:

    step(x [T, D], initial: tuple of [S, *shape], batch, layout, ops, decode)
        -> out [T, D], final: tuple of [S, *shape], saved: tuple of [C, *shape],
           at_drafts: tuple of [P, *shape]

where `saved[i][c]` is the state after absolute position `batch.save_pos[c]` of sequence
`batch.save_seq[c]` (the checkpoints this step stores) and `at_drafts[i][p]` the state after
position `batch.state_pos[p]` of sequence `batch.state_seq[p]` (the draft positions of the
sequences it verifies, for their live slots; P = 0 unless speculating).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class StateArray:
    """One array of a recurrent mixer's per-sequence state."""

    name: str
    shape: tuple[int, ...]  # per sequence
    float32: bool  # kept in float32 whatever the model dtype (recurrent states); else the model dtype
    split_axis: int | None  # the axis of `shape` a tensor-parallel mesh splits (heads); None: replicated

    def dtype(self, model_dtype: jnp.dtype) -> jnp.dtype:
        return jnp.dtype(jnp.float32) if self.float32 else jnp.dtype(model_dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, model_dtype: jnp.dtype) -> int:
        return self.size * self.dtype(model_dtype).itemsize


def state_bytes(arrays: tuple[StateArray, ...], model_dtype: jnp.dtype) -> int:
    """Bytes of one sequence's state of one layer."""
    return sum(a.nbytes(model_dtype) for a in arrays)


def _read_slots(pool: jax.Array, slots: jax.Array) -> jax.Array:
    """Each sequence's state from its read slot.

    With a single sequence the gather takes one extra row (the null slot 0) that is dropped
    again: with a single index XLA turns the gather into a dynamic slice and fuses copies of
    it into every consumer, some of which may run after the pool's in-place scatter, so it
    copies the whole pool (twice) on every one-sequence step instead."""
    if slots.shape[0] == 1:
        return pool[jnp.concatenate([slots, jnp.zeros((1,), slots.dtype)])][:1]  # [1, ...]
    return pool[slots]  # [S, ...]


def initial_states(
    pools: tuple[jax.Array, ...],  # each [num_slots, *shape]
    read_slots: jax.Array,  # [S] int32
    fresh: jax.Array,  # [S] bool: the sequence's first token this step is position 0
    hit: jax.Array | None,  # [S] bool: it resumes from a prefix hit's checkpoint
    restored: tuple[jax.Array, ...] | None,  # each [S, *shape]: the hits' checkpoint states
) -> tuple[jax.Array, ...]:  # each [S, *shape]
    """Each sequence's state before this step: its prefix hit's checkpoint where it has one,
    else its read slot's; zeros where it starts at position 0, whatever the slot last held."""
    out = []
    for i, pool in enumerate(pools):
        rows = _read_slots(pool, read_slots)
        mask = (-1,) + (1,) * (pool.ndim - 1)
        if hit is not None:
            rows = jnp.where(hit.reshape(mask), restored[i].astype(pool.dtype), rows)
        out.append(jnp.where(fresh.reshape(mask), 0, rows))
    return tuple(out)


def written_pools(
    pools: tuple[jax.Array, ...], write_slots: jax.Array, final: tuple[jax.Array, ...]
) -> tuple[jax.Array, ...]:
    """The pools with each sequence's state after this step in its write slot."""
    return tuple(pool.at[write_slots].set(f.astype(pool.dtype)) for pool, f in zip(pools, final))
