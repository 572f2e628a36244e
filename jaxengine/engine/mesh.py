"""The engine's device mesh, and where each parameter and pool lives on it.

One engine runs on a `Mesh(("data", "model"))`: tensor parallelism splits attention heads,
MLP columns, experts (or their columns), the vocabulary and recurrent mixers' channels over
the "model" axis; XLA inserts the collectives. A parameter's logical axes come from the
model (`models/axes.py`); `axis_rules` maps them to the mesh for one model and one tensor
parallel size. A dimension whose size the model axis does not divide stays replicated (KV
heads fewer than the devices are copied to each, as vLLM does).
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.models import axes
from jaxengine.models.config import ModelConfig
from jaxengine.models.mixer_state import StateArray
from jaxengine.models.mixers import MIXERS

DATA, MODEL = "data", "model"

Rules = dict[str, str | None]  # logical axis -> mesh axis (None: replicated)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """How one engine spreads over devices (vLLM's argument names)."""

    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    first_device: int = 0  # where in `jax.devices()` this engine's devices start (data-parallel replicas)

    def validate(self, cfg: ModelConfig, what: str = "the model") -> None:
        """Raises ValueError naming the engine argument and the model field that disagree,
        before anything is loaded."""
        tp = self.tensor_parallel_size
        available = len(jax.devices())
        if self.first_device + tp > available:
            raise ValueError(
                f"engine argument tensor_parallel_size={tp} exceeds the {available - self.first_device} "
                f"{jax.default_backend()} devices present"
            )
        if jax.process_count() > 1 and (tp != available or self.first_device):
            raise ValueError(
                f"engine argument tensor_parallel_size={tp} must be the {available} devices of all "
                f"{jax.process_count()} processes: one engine spans every host"
            )
        if self.enable_expert_parallel and cfg.moe is None:
            raise ValueError(f"engine argument enable_expert_parallel=True: {what} has no mixture-of-experts layers")
        for field, count in _split_counts(cfg, self.enable_expert_parallel):
            if count % tp:
                raise ValueError(f"engine argument tensor_parallel_size={tp} does not divide {what}'s {field}={count}")
        a = cfg.attention
        if a is not None and a.num_kv_heads % tp and tp % a.num_kv_heads:
            raise ValueError(
                f"engine argument tensor_parallel_size={tp} does not divide {what}'s "
                f"num_key_value_heads={a.num_kv_heads} (nor is it a multiple of it)"
            )

    def placement(self, cfg: ModelConfig) -> Callable[[nnx.Variable], NamedSharding]:
        """Where each of `cfg`'s parameters goes on this engine's mesh (`param_sharding`)."""
        mesh = self.mesh()
        return functools.partial(param_sharding, mesh=mesh, rules=axis_rules(cfg, mesh, self.enable_expert_parallel))

    def mesh(self) -> Mesh:
        """`tensor_parallel_size` devices from `first_device` on as a 1 x tp ("data", "model") mesh."""
        tp = self.tensor_parallel_size
        devices = np.array(jax.devices()[self.first_device : self.first_device + tp]).reshape(1, tp)
        return Mesh(devices, (DATA, MODEL))


def _split_counts(cfg: ModelConfig, expert_parallel: bool) -> list[tuple[str, int]]:
    """The model's counts that tensor parallelism splits, by their config.json names: those
    of each mixer type the config holds settings for (`MixerType.split`; Zamba2's shared
    block holds attention's without an attention layer), then the experts'."""
    counts = [kind.split(settings) for kind in MIXERS.values() if (settings := kind.config(cfg)) is not None]
    if cfg.moe is not None and expert_parallel:
        counts.append(("num_experts", cfg.moe.num_experts))
    return counts


def axis_rules(cfg: ModelConfig, mesh: Mesh, expert_parallel: bool = False) -> Rules:
    """The mesh axis each logical axis of `cfg`'s parameters and pools is split over."""
    tp = mesh.shape[MODEL]
    kv_split = cfg.attention is not None and cfg.attention.num_kv_heads % tp == 0
    return {
        axes.VOCAB: MODEL,
        axes.HEADS: MODEL,
        axes.KV_HEADS: MODEL if kv_split else None,
        axes.MLP: MODEL,
        axes.EXPERTS: MODEL if expert_parallel else None,
        axes.EXPERT_MLP: None if expert_parallel else MODEL,
        axes.RECURRENT: MODEL,
    }


def sharding(mesh: Mesh, rules: Rules, names: axes.Axes, shape: tuple[int, ...]) -> NamedSharding:
    """The sharding of an array of `shape` whose dimensions hold the logical axes `names`."""
    spec = []
    for name, size in zip(names, shape):
        axis = rules.get(name) if name else None
        spec.append(axis if axis is not None and size % mesh.shape[axis] == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*spec))


def param_sharding(var: nnx.Variable, mesh: Mesh, rules: Rules) -> NamedSharding:
    """Where a parameter goes: by the logical axes it declares (`models/axes.py`)."""
    value = var.get_value()
    names = var.get_metadata().get("out_sharding") or (None,) * value.ndim
    return sharding(mesh, rules, names, value.shape)


def param_shardings(params: nnx.State, mesh: Mesh, rules: Rules) -> list[NamedSharding]:
    """One sharding per leaf of `params`, in `jax.tree.leaves` order."""
    one = functools.partial(param_sharding, mesh=mesh, rules=rules)
    return jax.tree.leaves(jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable)))


def kv_page_sharding(mesh: Mesh, rules: Rules, shape: tuple[int, ...]) -> NamedSharding:
    """KV pages `[num_blocks, page_size, kv_heads, head_dim]`: split by KV head."""
    return sharding(mesh, rules, (None, None, axes.KV_HEADS, None), shape)


def state_sharding(mesh: Mesh, rules: Rules, array: StateArray, num_slots: int) -> NamedSharding:
    """A live state pool `[num_slots, *array.shape]`: split on the axis the mixer declares."""
    names = [None] * (1 + len(array.shape))
    if array.split_axis is not None:
        names[1 + array.split_axis] = axes.RECURRENT
    return sharding(mesh, rules, tuple(names), (num_slots, *array.shape))
