"""Allocation of the device pools: cache blocks (KV pages and checkpoints) and live state slots."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.models.batch import Pools
from jaxengine.models.checkpoint_store import CheckpointLayout, checkpoint_layout, stored_elems
from jaxengine.models.config import ModelConfig
from jaxengine.models.mixers import recurrent_states


def store_layout(cfg: ModelConfig, page_size: int, dtype: jnp.dtype) -> CheckpointLayout | None:
    """Where checkpoints lie in the cache blocks of `cfg` (None without recurrent layers):
    the same function of the same shapes the model step evaluates."""
    states = recurrent_states(cfg)
    if cfg.num_attention_layers:
        a = cfg.attention
        return checkpoint_layout(states, (page_size, a.num_kv_heads, a.head_dim), dtype, 2 * cfg.num_kv_layers)
    return checkpoint_layout(states, (recurrent_block_elems(cfg, dtype),), dtype, 1)


def recurrent_block_elems(cfg: ModelConfig, dtype: jnp.dtype) -> int:
    """A cache block's elements for a model without attention layers: the largest layer's
    stored state (a checkpoint is one block per layer)."""
    return max(stored_elems(arrays, dtype) for arrays in recurrent_states(cfg))


def allocate_pools(
    cfg: ModelConfig, *, num_blocks: int, page_size: int, num_slots: int, dtype: jnp.dtype, mesh: Mesh
) -> Pools:
    """Zero-filled pools; block 0 and slot 0 are the null sinks, so usable capacity is one less.

    Each recurrent layer gets a `[num_slots, *shape]` array per state array its mixer declares,
    in the declared dtype (float32 recurrent states, model-dtype conv windows)."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def zeros(shape: tuple[int, ...], dt: jnp.dtype) -> jax.Array:
        return jax.device_put(jnp.zeros(shape, dt), replicated)

    k_pages, v_pages, checkpoints = [], [], []
    for _ in range(cfg.num_kv_layers):  # the attention layers, then the MTP layers
        a = cfg.attention
        shape = (num_blocks, page_size, a.num_kv_heads, a.head_dim)
        k_pages.append(zeros(shape, dtype))
        v_pages.append(zeros(shape, dtype))
    states = tuple(
        tuple(zeros((num_slots, *a.shape), a.dtype(dtype)) for a in arrays) for arrays in recurrent_states(cfg)
    )
    if not k_pages and states:
        checkpoints.append(zeros((num_blocks, recurrent_block_elems(cfg, dtype)), dtype))
    return Pools(tuple(k_pages), tuple(v_pages), tuple(checkpoints), states)
