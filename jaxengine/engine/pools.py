"""Allocation of the device pools: cache blocks (KV pages and checkpoints) and live state slots."""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.engine.mesh import Rules, kv_page_sharding, state_sharding
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


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _zeros(shape: tuple[int, ...], dtype: jnp.dtype, where: NamedSharding) -> jax.Array:
    """A zero array made in place with sharding `where` (no full copy on one device)."""
    return jax.lax.with_sharding_constraint(jnp.zeros(shape, dtype), where)


def allocate_pools(
    cfg: ModelConfig, *, num_blocks: int, page_size: int, num_slots: int, dtype: jnp.dtype, mesh: Mesh, rules: Rules
) -> Pools:
    """Zero-filled pools, made in place on the mesh (KV pages split by KV head, live states on
    the axis their mixer declares, `mesh.py`); block 0 and slot 0 are the null sinks, so usable
    capacity is one less.

    Each recurrent layer gets a `[num_slots, *shape]` array per state array its mixer declares,
    in the declared dtype (float32 recurrent states, model-dtype conv windows)."""

    k_pages, v_pages, checkpoints = [], [], []
    for _ in range(cfg.num_kv_layers):  # the attention layers, then the MTP layers
        a = cfg.attention
        shape = (num_blocks, page_size, a.num_kv_heads, a.head_dim)
        k_pages.append(_zeros(shape, dtype, kv_page_sharding(mesh, rules, shape)))
        v_pages.append(_zeros(shape, dtype, kv_page_sharding(mesh, rules, shape)))
    states = tuple(
        tuple(_zeros((num_slots, *a.shape), a.dtype(dtype), state_sharding(mesh, rules, a, num_slots)) for a in arrays)
        for arrays in recurrent_states(cfg)
    )
    if not k_pages and states:
        checkpoints.append(
            _zeros((num_blocks, recurrent_block_elems(cfg, dtype)), dtype, NamedSharding(mesh, PartitionSpec()))
        )
    return Pools(tuple(k_pages), tuple(v_pages), tuple(checkpoints), states)


def pool_shardings(pools: Pools) -> Pools:
    """The shardings of `pools`, in their structure (what every step hands them back in)."""
    return jax.tree.map(lambda a: a.sharding, pools)
