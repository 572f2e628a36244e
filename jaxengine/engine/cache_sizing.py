"""Sizing an engine's cache pool, and the prefix cache over it."""

import dataclasses
import logging

import jax
import jax.numpy as jnp

from jaxengine.cache import checkpoint_policy
from jaxengine.cache.block_pool import BlockPool
from jaxengine.cache.hit_value import ModelCosts
from jaxengine.cache.prefix_cache import PrefixCache
from jaxengine.engine import multihost
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.pools import store_layout
from jaxengine.models.config import ModelConfig
from jaxengine.models.mixer_state import state_bytes
from jaxengine.models.mixers import recurrent_states

logger = logging.getLogger("jaxengine")


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """The cache pool as sized for one engine, and the prefix cache that keeps it."""

    cache: PrefixCache
    num_blocks: int
    block_bytes: int  # one KV page of every attention layer (the draft model's too)
    blocks_per_checkpoint: int  # 0: no recurrent layers
    retention_interval: int | None
    retention_reason: str  # why that interval (for the start-up log)
    config: EngineConfig  # with gpu_memory_utilization resolved to kv_cache_memory_bytes


def plan_cache(config: EngineConfig, cfg: ModelConfig, draft: ModelConfig | None, params: list) -> CachePlan:
    """Sizes the pool of cache blocks for the target `cfg` (and the draft model's `draft`,
    whose pages share the blocks): a checkpoint spans the blocks the larger of the two states
    needs. `params`: the models' parameters (what the prefix cache weighs hits by)."""
    caching = config.enable_prefix_caching
    dtype = jax.tree.leaves(params)[0].dtype
    layouts = [store_layout(c, config.page_size, dtype) for c in (cfg, draft) if c is not None]
    blocks_per_checkpoint = max((layout.blocks_per_checkpoint for layout in layouts if layout), default=0)
    block_bytes = config.block_bytes(cfg, draft)
    retention_interval, why = config.resolved_retention_interval(cfg)
    if config.gpu_memory_utilization is not None:
        config = dataclasses.replace(
            config, gpu_memory_utilization=None, kv_cache_memory_bytes=_device_pool_bytes(config, cfg, draft)
        )
    num_blocks = config.resolved_num_cache_blocks(cfg, blocks_per_checkpoint if caching else 0, draft)
    costs = _costs(cfg, params, blocks_per_checkpoint, block_bytes, config.page_size)
    cache = PrefixCache(
        BlockPool(num_blocks),
        page_size=config.page_size,
        has_kv=bool(cfg.num_attention_layers),
        checkpoint_blocks=blocks_per_checkpoint,
        value=costs.value_fn(),
        checkpoint_value=costs.checkpoint_value,
        enabled=caching,
    )
    return CachePlan(cache, num_blocks, block_bytes, blocks_per_checkpoint, retention_interval, why, config)


def _device_pool_bytes(config: EngineConfig, cfg: ModelConfig, draft: ModelConfig | None) -> int | None:
    """Bytes for the cache pool under gpu_memory_utilization: that fraction of the device's
    memory, less what is in use (the weights) and the live state slots. None (the default
    sizing) on a device that reports no memory limit, as a CPU does."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        logger.info(
            "engine argument gpu_memory_utilization has no effect on %s (no device memory limit): "
            "the pool gets its default size",
            jax.devices()[0].platform,
        )
        return None
    slots = config.resolved_num_ssm_slots() if cfg.num_recurrent_layers else 0
    models = [m for m in (cfg, draft) if m is not None]
    dtype = jnp.dtype(config.dtype)
    slot_bytes = sum(state_bytes(arrays, dtype) for m in models for arrays in recurrent_states(m))
    budget = int(config.gpu_memory_utilization * stats["bytes_limit"]) - stats.get("bytes_in_use", 0)
    budget -= slots * slot_bytes
    budget = multihost.from_process_0(budget)  # pools of one shape on every process
    if budget < 2 * config.block_bytes(cfg, draft):
        raise ValueError(
            f"engine argument gpu_memory_utilization={config.gpu_memory_utilization} leaves "
            f"no room for the cache pool ({stats.get('bytes_in_use', 0)} bytes in use of "
            f"{stats['bytes_limit']})"
        )
    return budget


def _costs(cfg: ModelConfig, params: list, blocks_per_checkpoint: int, block_bytes: int, page_size: int) -> ModelCosts:
    """What the prefix cache weighs hits by (`hit_value.py`); `params`: the target's and the
    draft model's (whose work a hit saves too)."""
    a = cfg.attention
    return ModelCosts(
        num_weights=sum(x.size for x in jax.tree.leaves(params)),
        attention_width=cfg.num_attention_layers * a.num_heads * a.head_dim if a else 0,
        kv_bytes_per_token=block_bytes // page_size if cfg.num_attention_layers else 0,
        checkpoint_bytes=blocks_per_checkpoint * block_bytes,
    )


def log_plan(plan: CachePlan, cfg: ModelConfig) -> None:
    """The start-up log line saying how checkpoints are kept, for a model with recurrent layers."""
    if plan.config.enable_prefix_caching and cfg.num_recurrent_layers:
        logger.info(
            "prefix cache: retention %s (prefix_cache_retention_interval=%r, %s); one checkpoint = %d blocks "
            "of %d bytes in a pool of %d blocks",
            checkpoint_policy.describe_interval(plan.retention_interval),
            plan.retention_interval,
            plan.retention_reason,
            plan.blocks_per_checkpoint,
            plan.block_bytes,
            plan.num_blocks,
        )
