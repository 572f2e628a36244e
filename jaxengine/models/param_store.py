"""The Orbax store of converted parameters: what `jaxengine convert` writes next to
config.json, read back straight into each parameter's sharding."""

from collections.abc import Callable
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

CONVERTED_PARAMS_DIR = "jaxengine_params"  # the Orbax checkpoint inside a converted model directory


def save_params(state: nnx.State, out_dir: Path) -> None:
    """Stores parameters with Orbax under `out_dir/jaxengine_params`."""
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save((Path(out_dir) / CONVERTED_PARAMS_DIR).absolute(), state.to_pure_dict())


def restore_params(
    path: Path, abstract_state: nnx.State, place: Callable[[nnx.Variable], jax.sharding.Sharding] | None = None
) -> dict:
    """Restores parameters stored by `save_params`, with the abstract state's shapes and dtypes,
    each in the sharding `place` gives it (default: the default device)."""

    def target(var: nnx.Variable) -> jax.ShapeDtypeStruct:
        value = var.get_value()
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=place(var) if place else None)

    target = jax.tree.map(target, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable)).to_pure_dict()
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(path.absolute(), target)
