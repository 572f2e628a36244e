"""The model runner: owns the parameters and the donated pools and runs jitted steps."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxengine.engine.pools import allocate_pools
from jaxengine.models.batch import Pools, StepBatch
from jaxengine.models.config import ModelConfig


@functools.partial(jax.jit, static_argnames=("graphdef", "decode", "all_logits"), donate_argnames=("pools",))
def model_step(
    graphdef: nnx.GraphDef, params: nnx.State, pools: Pools, batch: StepBatch, *, decode: bool, all_logits: bool
) -> tuple[jax.Array, Pools]:
    """One pure forward step: merges the model inside, returns logits and the new pools."""
    model = nnx.merge(graphdef, params)
    return model(pools, batch, decode=decode, all_logits=all_logits)


class ModelRunner:
    """Holds a model's parameters and pools on a device mesh and runs steps on host-built batches."""

    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        params: nnx.State,
        *,
        num_pages: int,
        page_size: int,
        num_slots: int,
        mesh: Mesh | None = None,
    ):
        self.cfg = cfg
        self.page_size = page_size
        self.mesh = mesh or Mesh(np.array(jax.devices()[:1]), ("model",))
        self.graphdef = graphdef
        self.params = jax.device_put(params, NamedSharding(self.mesh, PartitionSpec()))
        dtype = jax.tree.leaves(params)[0].dtype
        self.pools = allocate_pools(
            cfg, num_pages=num_pages, page_size=page_size, num_slots=num_slots, dtype=dtype, mesh=self.mesh
        )

    def step(self, batch: StepBatch, *, decode: bool = False, all_logits: bool = False) -> jax.Array:
        """Runs one step, replacing the pools with the updated ones; returns float32 logits."""
        batch = jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), batch)
        logits, self.pools = model_step(
            self.graphdef, self.params, self.pools, batch, decode=decode, all_logits=all_logits
        )
        return logits
