"""Allocation of the device pools: cache blocks (KV pages and checkpoints) and live state slots."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.models.batch import Pools
from jaxengine.models.checkpoint_store import CheckpointLayout, checkpoint_layout, recurrent_unit_elems
from jaxengine.models.config import ModelConfig


def store_layout(cfg: ModelConfig, page_size: int, dtype: jnp.dtype) -> CheckpointLayout | None:
    """Where checkpoints lie in the cache blocks of `cfg` (None without recurrent layers):
    the same function of the same shapes the model step evaluates."""
    if cfg.num_attention_layers:
        a = cfg.attention
        return checkpoint_layout(cfg, (page_size, a.num_kv_heads, a.head_dim), dtype, 2 * cfg.num_attention_layers)
    return checkpoint_layout(cfg, (recurrent_unit_elems(cfg, dtype),), dtype, 1)


def allocate_pools(
    cfg: ModelConfig, *, num_blocks: int, page_size: int, num_slots: int, dtype: jnp.dtype, mesh: Mesh
) -> Pools:
    """Zero-filled pools; block 0 and slot 0 are the null sinks, so usable capacity is one less.

    The SSM state is float32 whatever the model dtype; the conv state follows the model dtype."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def zeros(shape: tuple[int, ...], dt: jnp.dtype) -> jax.Array:
        return jax.device_put(jnp.zeros(shape, dt), replicated)

    k_pages, v_pages, checkpoints, conv, ssm = [], [], [], [], []
    for spec in cfg.layers:
        if spec.mixer == "attention":
            a = cfg.attention
            shape = (num_blocks, page_size, a.num_kv_heads, a.head_dim)
            k_pages.append(zeros(shape, dtype))
            v_pages.append(zeros(shape, dtype))
        elif spec.mixer == "mamba":
            m = cfg.mamba
            conv.append(zeros((num_slots, m.conv_dim, m.conv_kernel), dtype))
            ssm.append(zeros((num_slots, m.num_heads, m.head_dim, m.state_size), jnp.float32))
    if not k_pages and cfg.num_mamba_layers:
        checkpoints.append(zeros((num_blocks, recurrent_unit_elems(cfg, dtype)), dtype))
    return Pools(tuple(k_pages), tuple(v_pages), tuple(checkpoints), tuple(conv), tuple(ssm))
