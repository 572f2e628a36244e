"""Allocation of the device pools: paged KV per attention layer, SSM slots per Mamba layer."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.models.batch import Pools
from jaxengine.models.config import ModelConfig


def allocate_pools(
    cfg: ModelConfig, *, num_pages: int, page_size: int, num_slots: int, dtype: jnp.dtype, mesh: Mesh
) -> Pools:
    """Zero-filled pools; page 0 and slot 0 are the null sinks, so usable capacity is one less.

    The SSM state is float32 whatever the model dtype; the conv state follows the model dtype."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def zeros(shape: tuple[int, ...], dt: jnp.dtype) -> jax.Array:
        return jax.device_put(jnp.zeros(shape, dt), replicated)

    k_pages, v_pages, conv, ssm = [], [], [], []
    for spec in cfg.layers:
        if spec.mixer == "attention":
            a = cfg.attention
            shape = (num_pages, page_size, a.num_kv_heads, a.head_dim)
            k_pages.append(zeros(shape, dtype))
            v_pages.append(zeros(shape, dtype))
        elif spec.mixer == "mamba":
            m = cfg.mamba
            conv.append(zeros((num_slots, m.conv_dim, m.conv_kernel), dtype))
            ssm.append(zeros((num_slots, m.num_heads, m.head_dim, m.state_size), jnp.float32))
    return Pools(tuple(k_pages), tuple(v_pages), tuple(conv), tuple(ssm))
