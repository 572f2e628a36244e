"""Loading the draft model of speculative decoding's `draft_model` method, and what it must
share with the target (`models/draft_chain.py` runs it)."""

from pathlib import Path

from flax import nnx

from jaxengine.engine.mesh import Parallelism
from jaxengine.models.arch import load_model_config
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_model

WHERE = "engine argument speculative_config.model"


def load_draft(
    model_dir: str, target: ModelConfig, *, dtype: str, kernels: str, max_model_len: int, parallelism: Parallelism
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
    """The draft model at `model_dir`, in the target's dtype and kernels; a ValueError naming
    the field if it cannot draft for `target`.

    Its pools are laid out as the target's (same block and slot indices), so it needs what the
    target's cache bookkeeping provides: KV pages only if the target has attention layers,
    live slots and checkpoints only if the target has recurrent layers."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{WHERE}={model_dir!r} is not a model directory (no config.json)")
    try:
        cfg = load_model_config(path)
    except ValueError as err:
        raise ValueError(f"{WHERE}={model_dir!r}: {err}") from None
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"{WHERE}={model_dir!r}: its vocabulary ({cfg.vocab_size} tokens) is not the target's ({target.vocab_size})"
        )
    if cfg.num_attention_layers and not target.num_attention_layers:
        raise ValueError(f"{WHERE}={model_dir!r} has attention layers; a target without any keeps no KV pages for it")
    if cfg.num_recurrent_layers and not target.num_recurrent_layers:
        raise ValueError(
            f"{WHERE}={model_dir!r} has recurrent layers; a target without any keeps no state "
            f"slots or checkpoints for it"
        )
    if cfg.num_attention_layers and max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"{WHERE}={model_dir!r}: max_model_len={max_model_len} exceeds the draft's "
            f"max_position_embeddings={cfg.max_position_embeddings}"
        )
    parallelism.validate(cfg, f"the draft model {WHERE}={model_dir!r}")
    return load_model(path, dtype, kernels, place=parallelism.placement(cfg))
