"""The logical axes a parameter declares where it is made, for tensor parallelism.

A model names what each dimension of a weight holds (attention heads, MLP columns, experts,
the vocabulary, a recurrent mixer's channels); the engine maps those names to the axes of
its device mesh (`engine/mesh.py`), so the models know nothing of devices. A dimension with
no name (None) is replicated.
"""

import jax
from flax import nnx

VOCAB = "vocab"  # the embedding's rows and the LM head's columns
HEADS = "heads"  # attention query heads: q columns (and their gates), o rows
KV_HEADS = "kv_heads"  # attention key/value heads: k and v columns, the KV pages' head axis
MLP = "mlp"  # a dense MLP's hidden columns
EXPERTS = "experts"  # a mixture's experts (split under expert parallelism)
EXPERT_MLP = "expert_mlp"  # an expert's hidden columns (split without expert parallelism)
RECURRENT = "recurrent"  # a recurrent mixer's channels and heads (projections, conv, state)

Axes = tuple[str | None, ...]


def param(value: jax.Array, axes: Axes) -> nnx.Param:
    """A parameter whose dimensions hold `axes` (one name or None per dimension)."""
    if len(axes) != value.ndim:
        raise ValueError(f"axes {axes} do not match a parameter of shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def linear_metadata(inputs: str | None, outputs: str | None) -> dict:
    """`nnx.Linear` keyword arguments declaring its kernel `[in, out]` and bias `[out]` axes."""
    return dict(
        kernel_metadata=dict(out_sharding=(inputs, outputs), eager_sharding=False),
        bias_metadata=dict(out_sharding=(outputs,), eager_sharding=False),
    )
