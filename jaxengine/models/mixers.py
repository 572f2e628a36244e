"""The mixer types a decoder layer can hold, and what is derived from their declarations.

A mixer type is its module (built as `module(hidden_size, config, eps, dtype=, rngs=)`), the
`ModelConfig` field holding its settings, what tensor parallelism splits it by, and, for
recurrent mixers, the function declaring its per-sequence state (`mixer_state.py`).
Attention keeps no per-sequence state: its KV lives in the cache pages. Adding a mixer type
is its module file, a line here, the config mapping of the families that use it (`arch/`)
and its kernels (`kernels.py`).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import nnx

from jaxengine.models.attention import Attention
from jaxengine.models.config import ModelConfig
from jaxengine.models.gated_delta import GatedDeltaMixer, gated_delta_state
from jaxengine.models.mamba1 import Mamba1Mixer, mamba1_state
from jaxengine.models.mamba2 import Mamba2Mixer, mamba2_state
from jaxengine.models.mixer_state import StateArray
from jaxengine.models.short_conv import ShortConvMixer, short_conv_state


@dataclasses.dataclass(frozen=True)
class MixerType:
    """`split(settings)`: the count tensor parallelism splits the mixer's heads or channels by
    (over the "model" mesh axis, `axes.HEADS` or `axes.RECURRENT`), as (its config.json name,
    the count); the engine's tensor parallel size must divide it."""

    module: type[nnx.Module]
    config: Callable[[ModelConfig], Any]  # the mixer's settings in a ModelConfig
    state: Callable[[Any], tuple[StateArray, ...]] | None  # per-sequence state; None: none (attention)
    split: Callable[[Any], tuple[str, int]]


MIXERS: dict[str, MixerType] = {
    "attention": MixerType(Attention, lambda cfg: cfg.attention, None, lambda a: ("num_attention_heads", a.num_heads)),
    "mamba": MixerType(Mamba2Mixer, lambda cfg: cfg.mamba, mamba2_state, lambda m: ("mamba_n_heads", m.num_heads)),
    "mamba1": MixerType(
        Mamba1Mixer, lambda cfg: cfg.mamba1, mamba1_state, lambda m: ("mamba_expand * hidden_size", m.intermediate_size)
    ),
    "gated_delta": MixerType(
        GatedDeltaMixer,
        lambda cfg: cfg.gated_delta,
        gated_delta_state,
        lambda g: ("linear_num_value_heads", g.num_value_heads),
    ),
    "short_conv": MixerType(
        ShortConvMixer, lambda cfg: cfg.short_conv, short_conv_state, lambda c: ("hidden_size", c.channels)
    ),
}


def recurrent_states(cfg: ModelConfig) -> list[tuple[StateArray, ...]]:
    """The declared per-sequence state of every recurrent layer of `cfg`, in layer order."""
    out = []
    for spec in cfg.layers:
        for name in spec.mixers:
            kind = MIXERS[name]
            if kind.state is not None:
                out.append(kind.state(kind.config(cfg)))
    return out
