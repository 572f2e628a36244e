"""Recurrent-state checkpoints kept in the cache blocks: where each layer's state lies.

The prefix cache holds KV pages and checkpoints in the same blocks (`jaxengine/cache/`).
The *store arrays* are the K and V page arrays of every attention layer, in the order
k0, v0, k1, v1, ... (a model without attention layers has one store array of its own); a
block is one page of every store array, and a *unit* is one page of one store array. A
checkpoint spans `blocks_per_checkpoint` blocks, the same offsets in every store array.

Each recurrent layer's state (its mixer's declared arrays in order, flattened, see
`mixer_state.py`) is cut into *pieces* of whole units; a piece lies in one store array, in consecutive blocks of the checkpoint, so
saving or restoring a layer is one scatter or gather per piece. Pieces are spread over the
arrays so that they fill about the same number of blocks.

Arrays declared float32 (the recurrent states) stay float32: a float32 store (float32 models)
keeps them exactly; a bfloat16 store keeps each value as the sum of two bfloat16 numbers (its rounding and the rounding of the
rest), 16 significant bits, a relative error below 2**-16. Raw float32 bits split into two
bfloat16 halves would not do: a half can be a NaN bit pattern, and XLA may rewrite NaN
payloads in any bfloat16 operation, including the KV page writes into the same arrays.

Everything here is static (shapes and offsets) except `read` and `write`, which are pure
index gathers and scatters on device.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxengine.models.mixer_state import StateArray


@dataclasses.dataclass(frozen=True)
class Piece:
    """Units `[start_unit, start_unit + num_units)` of a layer's flat state, stored in array
    `array` at the checkpoint's blocks `[first_block, first_block + num_units)`."""

    array: int
    first_block: int
    start_unit: int
    num_units: int


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    arrays: tuple[StateArray, ...]  # the layer's declared state, in flattening order
    pieces: tuple[Piece, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointLayout:
    """Where every recurrent layer's checkpoint state lies in the store arrays."""

    unit_shape: tuple[int, ...]  # one page of a store array
    store_dtype: jnp.dtype
    num_arrays: int
    layers: tuple[LayerLayout, ...]
    blocks_per_checkpoint: int

    @property
    def unit_elems(self) -> int:
        return math.prod(self.unit_shape)

    def read(self, arrays: list[jax.Array], blocks: jax.Array, j: int) -> tuple[jax.Array, ...]:
        """Layer `j`'s state arrays, each [S, *shape], of the checkpoints at `blocks`
        [S, blocks_per_checkpoint]."""
        layer = self.layers[j]
        num = blocks.shape[0]
        parts = [
            arrays[p.array][blocks[:, p.first_block : p.first_block + p.num_units]].reshape(num, -1)
            for p in layer.pieces
        ]
        flat = jnp.concatenate(parts, axis=1)
        out, offset = [], 0
        for a in layer.arrays:
            words = _words(a, self.store_dtype)
            values = flat[:, offset : offset + a.size * words]
            offset += a.size * words
            if a.float32:
                values = values.astype(jnp.float32)
                if words == 2:
                    pairs = values.reshape(num, -1, 2)
                    values = pairs[..., 0] + pairs[..., 1]
            out.append(values.reshape(num, *a.shape))
        return tuple(out)

    def write(self, arrays: list[jax.Array], blocks: jax.Array, j: int, states: tuple[jax.Array, ...]) -> None:
        """Stores layer `j`'s state arrays `states` (each [C, *shape]) into the checkpoints at
        `blocks` [C, blocks_per_checkpoint] (in place in `arrays`)."""
        layer = self.layers[j]
        num = blocks.shape[0]
        parts = []
        for a, values in zip(layer.arrays, states):
            if a.float32:
                values = values.astype(jnp.float32).reshape(num, -1)
                if _words(a, self.store_dtype) == 2:
                    high = values.astype(self.store_dtype)
                    low = (values - high.astype(jnp.float32)).astype(self.store_dtype)
                    values = jnp.stack([high, low], axis=-1)
            parts.append(values.astype(self.store_dtype).reshape(num, -1))
        flat = jnp.concatenate(parts, axis=1)
        total_units = sum(p.num_units for p in layer.pieces)
        flat = jnp.pad(flat, ((0, 0), (0, total_units * self.unit_elems - flat.shape[1])))
        units = flat.reshape(num, total_units, *self.unit_shape)
        for p in layer.pieces:
            index = blocks[:, p.first_block : p.first_block + p.num_units]
            arrays[p.array] = arrays[p.array].at[index].set(units[:, p.start_unit : p.start_unit + p.num_units])


def _f32_words(store_dtype: jnp.dtype) -> int:
    """Store elements per float32 value."""
    size = jnp.dtype(store_dtype).itemsize
    if size not in (2, 4):
        raise ValueError(f"checkpoints need a 2- or 4-byte store dtype, got {jnp.dtype(store_dtype).name}")
    return 4 // size


def _words(array: StateArray, store_dtype: jnp.dtype) -> int:
    """Store elements per element of `array`."""
    return _f32_words(store_dtype) if array.float32 else 1


def stored_elems(arrays: tuple[StateArray, ...], store_dtype: jnp.dtype) -> int:
    """Store elements of one layer's state."""
    return sum(a.size * _words(a, store_dtype) for a in arrays)


def checkpoint_layout(
    states: list[tuple[StateArray, ...]], unit_shape: tuple[int, ...], store_dtype: jnp.dtype, num_arrays: int
) -> CheckpointLayout | None:
    """The layout of one checkpoint of every recurrent layer, whose declared states are
    `states` (in layer order), over `num_arrays` store arrays of pages `unit_shape`; None
    for a model without recurrent layers."""
    if not states:
        return None
    unit_elems = math.prod(unit_shape)
    num_layers = len(states)
    # Split each layer into just enough pieces that they spread evenly over the arrays (6
    # layers over 4 arrays: halves; 1 layer over 8 arrays: eighths; 24 over 8: whole layers).
    split = num_arrays // math.gcd(num_layers, num_arrays)
    filled = [0] * num_arrays  # blocks used so far in each array
    layers = []
    for arrays in states:
        layer_units = math.ceil(stored_elems(arrays, store_dtype) / unit_elems)
        pieces, start = [], 0
        num_pieces = max(1, min(layer_units, split))
        for s in range(num_pieces):
            size = layer_units // num_pieces + (1 if s < layer_units % num_pieces else 0)
            array = min(range(num_arrays), key=lambda a: filled[a])
            pieces.append(Piece(array, filled[array], start, size))
            filled[array] += size
            start += size
        layers.append(LayerLayout(tuple(arrays), tuple(pieces)))
    return CheckpointLayout(tuple(unit_shape), jnp.dtype(store_dtype), num_arrays, tuple(layers), max(filled))
