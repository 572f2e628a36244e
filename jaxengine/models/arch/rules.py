"""Tensor rules: how a Hugging Face tensor name becomes a parameter of `HybridLM`.

A family lists `Rule`s (its file under `arch/`); `safetensors_loader.py` applies them. The
builders here spell the rules several families share: a layer's attention, MLP, norms and
Mamba2 mixer under their usual names, the embedding, final norm and output projection.
"""

import dataclasses
import re
from collections.abc import Callable

import numpy as np

from jaxengine.models.config import ModelConfig

ParamPath = tuple[str | int, ...]  # ("layers", 3, "mamba", "in_proj", "kernel")
Targets = Callable[[re.Match, ModelConfig], list[ParamPath]]


@dataclasses.dataclass(frozen=True)
class Rule:
    """Maps the tensors whose names match `pattern` onto parameter paths.

    `targets(match, cfg)` gives the parameter path (or paths, for a split); `kind` says how
    the Hugging Face tensor is laid out relative to ours:
      copy        same layout
      linear      [out, in] -> [in, out]
      conv        [C, 1, K] -> [C, K]
      experts     [E, out, in] -> [E, in, out]
      expert      one expert's [out, in] -> row `expert` of a stacked [E, in, out]
      split       fused [2 * n, in] -> two [in, n] halves (gate, up); a bias [2 * n] -> two [n]
      columns     [width, in] -> columns [start, start + width) of an [in, total] parameter
                  (of row `expert` of a stacked [E, in, total] one when the pattern names an
                  expert), its rows first reordered by `perm`; `columns(match, cfg)` gives
                  (start, width, perm or None)
    `scale(match, cfg)`, when given, is a factor broadcast against the Hugging Face tensor
    (a scalar, or `[out, 1]` over a linear weight's rows) that multiplies it in float32.
    """

    pattern: str
    targets: Targets
    kind: str = "copy"
    columns: Callable[[re.Match, ModelConfig], tuple[int, int, np.ndarray | None]] | None = None
    scale: Callable[[re.Match, ModelConfig], np.ndarray] | None = None


def layer(path: str) -> Targets:
    """Target `layers/<N>/<path>`, with `{sub}` filled from the match and `{ffn}` the layer's
    feed-forward module ("mlp" or "moe")."""

    def targets(m: re.Match, cfg: ModelConfig) -> list[ParamPath]:
        i = int(m.group("layer"))
        spec = cfg.layers[i] if i < len(cfg.layers) else None
        ffn = spec.ffn if spec else "mlp"
        filled = path.format(ffn=ffn, shared="shared" if ffn == "moe" else "", **m.groupdict())
        return [("layers", i, *(p for p in filled.split("/") if p))]

    return targets


def top(*path: str) -> Targets:
    """Target the model-level parameter `path` ("embed", "final_norm/weight", ...)."""
    return lambda m, cfg: [tuple(path)]


def layer_paths(*paths: str) -> Targets:
    """Target several `layer` paths: the halves of a `split` tensor."""
    return lambda m, cfg: [t for p in paths for t in layer(p)(m, cfg)]


LAYER = r"(?:model|backbone)\.layers\.(?P<layer>\d+)\."  # a layer's tensor names start so


def conv_rules(prefix: str, mixer: str) -> list[Rule]:
    """A recurrent mixer's depthwise conv, `<layer>.<prefix>.weight` and `.bias`."""
    return [
        Rule(LAYER + prefix + r"\.weight$", layer(f"{mixer}/conv_weight"), "conv"),
        Rule(LAYER + prefix + r"\.bias$", layer(f"{mixer}/conv_bias")),
    ]


def mamba_rules(prefix: str) -> list[Rule]:
    """A Mamba2 mixer's tensors, named `<layer>.<prefix>.<tensor>`."""
    p = LAYER + prefix + r"\."
    return [
        Rule(p + r"(?P<sub>in_proj|out_proj)\.weight$", layer("mamba/{sub}/kernel"), "linear"),
        Rule(p + r"(?P<sub>in_proj|out_proj)\.bias$", layer("mamba/{sub}/bias")),
        *conv_rules(prefix + r"\.conv1d", "mamba"),
        Rule(p + r"(?P<p>dt_bias|A_log|D)$", layer("mamba/{p}")),
        Rule(p + r"norm\.weight$", layer("mamba/norm/weight")),
    ]


MAMBA = mamba_rules(r"(?:mamba|mixer)")  # as transformers names a Mamba2 mixer's tensors


def attention_rules(prefix: str) -> list[Rule]:
    """An attention mixer's q, k, v and o projections (weights and biases), `<layer>.<prefix>.[qkvo]_proj`."""
    return [
        Rule(LAYER + prefix + r"\.(?P<sub>[qkvo]_proj)\.weight$", layer("attention/{sub}/kernel"), "linear"),
        Rule(LAYER + prefix + r"\.(?P<sub>[qkvo]_proj)\.bias$", layer("attention/{sub}/bias")),
    ]


def mlp_rules(prefix: str) -> list[Rule]:
    """A dense MLP's gate, up and down projections, `<layer>.<prefix>.{gate,up,down}_proj`."""
    return [
        Rule(LAYER + prefix + r"\.(?P<sub>gate_proj|up_proj|down_proj)\.weight$", layer("mlp/{sub}/kernel"), "linear"),
        Rule(LAYER + prefix + r"\.(?P<sub>gate_proj|up_proj|down_proj)\.bias$", layer("mlp/{sub}/bias")),
    ]


def norm_rules(mixer_norm: str, ffn_norm: str) -> list[Rule]:
    """A layer's two pre-norms: before its mixer and before its feed-forward."""
    return [
        Rule(LAYER + mixer_norm + r"\.weight$", layer("mixer_norm/weight")),
        Rule(LAYER + ffn_norm + r"\.weight$", layer("ffn_norm/weight")),
    ]


def embed_and_head(embed: str, final_norm: str) -> list[Rule]:
    """The embedding, the final norm and `lm_head` (skipped when tied)."""
    return [
        Rule(embed + r"$", top("embed")),
        Rule(final_norm + r"$", top("final_norm", "weight")),
        Rule(r"lm_head\.weight$", top("lm_head", "kernel"), "linear"),
    ]


def scaled(rules: list[Rule], scale: Callable[[re.Match, ModelConfig], np.ndarray]) -> list[Rule]:
    """`rules`, each multiplying its tensor by `scale` (constant multipliers folded into weights)."""
    return [dataclasses.replace(rule, scale=scale) for rule in rules]


def expert_half(m: re.Match, cfg: ModelConfig) -> tuple[int, int, None]:
    """A per-expert gate or up projection: the first or second half of our fused gate | up."""
    inner = cfg.moe.expert.intermediate_size
    return (0 if m.group("half") == "gate" else inner), inner, None
