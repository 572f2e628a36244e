"""Recurrent-state checkpoints kept in the cache blocks: where each layer's state lies.

The prefix cache holds KV pages and checkpoints in the same blocks (`jaxengine/cache/`).
The *store arrays* are the K and V page arrays of every attention layer, in the order
k0, v0, k1, v1, ... (a model without attention layers has one store array of its own); a
block is one page of every store array, and a *unit* is one page of one store array. A
checkpoint spans `blocks_per_checkpoint` blocks, the same offsets in every store array.

Each recurrent layer's state (conv state then SSM state, flattened) is cut into *pieces* of
whole units; a piece lies in one store array, in consecutive blocks of the checkpoint, so
saving or restoring a layer is one scatter or gather per piece. Pieces are spread over the
arrays so that they fill about the same number of blocks.

The SSM state is float32. A float32 store (float32 models) keeps it exactly; a bfloat16 store
keeps each value as the sum of two bfloat16 numbers (its rounding and the rounding of the
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

from jaxengine.models.config import ModelConfig


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
    conv_shape: tuple[int, ...]  # [conv_dim, K], store dtype
    ssm_shape: tuple[int, ...]  # [H, P, N], float32
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

    def _flat_size(self, layer: LayerLayout) -> int:
        return math.prod(layer.conv_shape) + math.prod(layer.ssm_shape) * _f32_words(self.store_dtype)

    def read(self, arrays: list[jax.Array], blocks: jax.Array, j: int) -> tuple[jax.Array, jax.Array]:
        """Layer `j`'s conv [S, conv_dim, K] and SSM [S, H, P, N] float32 states of the
        checkpoints at `blocks` [S, blocks_per_checkpoint]."""
        layer = self.layers[j]
        num = blocks.shape[0]
        parts = [
            arrays[p.array][blocks[:, p.first_block : p.first_block + p.num_units]].reshape(num, -1)
            for p in layer.pieces
        ]
        flat = jnp.concatenate(parts, axis=1)[:, : self._flat_size(layer)]
        conv_size = math.prod(layer.conv_shape)
        conv = flat[:, :conv_size].reshape(num, *layer.conv_shape)
        ssm = flat[:, conv_size:].astype(jnp.float32)
        if _f32_words(self.store_dtype) == 2:
            pairs = ssm.reshape(num, -1, 2)
            ssm = pairs[..., 0] + pairs[..., 1]
        return conv, ssm.reshape(num, *layer.ssm_shape)

    def write(self, arrays: list[jax.Array], blocks: jax.Array, j: int, conv: jax.Array, ssm: jax.Array) -> None:
        """Stores layer `j`'s states conv [C, conv_dim, K] and SSM [C, H, P, N] into the
        checkpoints at `blocks` [C, blocks_per_checkpoint] (in place in `arrays`)."""
        layer = self.layers[j]
        num = blocks.shape[0]
        ssm = ssm.astype(jnp.float32).reshape(num, -1)
        if _f32_words(self.store_dtype) == 2:
            high = ssm.astype(self.store_dtype)
            low = (ssm - high.astype(jnp.float32)).astype(self.store_dtype)
            ssm = jnp.stack([high, low], axis=-1).reshape(num, -1)
        flat = jnp.concatenate([conv.astype(self.store_dtype).reshape(num, -1), ssm.astype(self.store_dtype)], axis=1)
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


def recurrent_unit_elems(cfg: ModelConfig, store_dtype: jnp.dtype) -> int:
    """Store elements of one recurrent layer's state: a block's size for models without
    attention layers (one unit per layer)."""
    m = cfg.mamba
    return m.conv_dim * m.conv_kernel + m.num_heads * m.head_dim * m.state_size * _f32_words(store_dtype)


def checkpoint_layout(
    cfg: ModelConfig, unit_shape: tuple[int, ...], store_dtype: jnp.dtype, num_arrays: int
) -> CheckpointLayout | None:
    """The layout of one checkpoint of every recurrent layer of `cfg` over `num_arrays` store
    arrays of pages `unit_shape`; None for a model without recurrent layers."""
    if not cfg.num_mamba_layers:
        return None
    m = cfg.mamba
    conv_shape, ssm_shape = (m.conv_dim, m.conv_kernel), (m.num_heads, m.head_dim, m.state_size)
    unit_elems = math.prod(unit_shape)
    layer_units = math.ceil(recurrent_unit_elems(cfg, store_dtype) / unit_elems)
    num_layers = cfg.num_mamba_layers
    # Split each layer into just enough pieces that they spread evenly over the arrays (6
    # layers over 4 arrays: halves; 1 layer over 8 arrays: eighths; 24 over 8: whole layers).
    split = max(1, min(layer_units, num_arrays // math.gcd(num_layers, num_arrays)))
    filled = [0] * num_arrays  # blocks used so far in each array
    layers = []
    for _ in range(num_layers):
        pieces, start = [], 0
        for s in range(split):
            size = layer_units // split + (1 if s < layer_units % split else 0)
            array = min(range(num_arrays), key=lambda a: filled[a])
            pieces.append(Piece(array, filled[array], start, size))
            filled[array] += size
            start += size
        layers.append(LayerLayout(conv_shape, ssm_shape, tuple(pieces)))
    return CheckpointLayout(tuple(unit_shape), jnp.dtype(store_dtype), num_arrays, tuple(layers), max(filled))
