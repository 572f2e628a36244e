"""A model directory -> the model: its config, graph and parameters.

A Hugging Face directory's safetensors are converted by its family's rules
(`safetensors_loader.py`); a directory converted by `jaxengine convert` holds the converted
parameters in Orbax's format (`param_store.py`), restored instead.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jaxengine.models.arch import load_model_config
from jaxengine.models.config import ModelConfig
from jaxengine.models.hybrid import HybridLM
from jaxengine.models.param_store import CONVERTED_PARAMS_DIR, restore_params
from jaxengine.models.safetensors_loader import params_from_hf


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype, kernels: str = "auto") -> HybridLM:
    """The model's structure with shapes and dtypes but no values."""
    return nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels))


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    kernels: str = "auto",
    *,
    mtp: bool = False,
    place: Callable[[nnx.Variable], jax.sharding.Sharding] | None = None,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """Loads a model directory (Hugging Face, or converted by `jaxengine convert`), with its
    MTP module when `mtp` (the config must declare one). `place`: where each parameter goes
    (the engine's mesh); converted parameters are restored straight into those shardings, each
    process reading its shards; Hugging Face tensors are read to host memory either way.

    Returns the config, the graph definition and the parameter state, ready for `nnx.merge`."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"unsupported dtype={dtype!r}; supported: float32, bfloat16, float16")
    model_dir = Path(model_dir)
    declared = load_model_config(model_dir)
    cfg = declared if mtp else dataclasses.replace(declared, mtp_layers=())
    graphdef, state = nnx.split(abstract_model(cfg, jnp.dtype(dtype), kernels))
    converted = model_dir / CONVERTED_PARAMS_DIR
    if converted.is_dir():  # stored with the MTP module its config declares (`jaxengine convert`)
        stored = state if cfg == declared else nnx.split(abstract_model(declared, jnp.dtype(dtype), kernels))[1]
        params = restore_params(converted, stored, place)
        if not mtp:
            params.pop("mtp", None)
    else:
        params = params_from_hf(model_dir, cfg, state)
    state.replace_by_pure_dict(params)
    return cfg, graphdef, state
