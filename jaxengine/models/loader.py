"""Hugging Face checkpoint -> model parameters, and the Orbax store of converted parameters.

Each architecture names its tensors differently; a table of rules per architecture maps a
Hugging Face tensor name onto a parameter path of `HybridLM` and says how to convert it
(transpose a linear weight, squeeze a conv weight, stack per-expert tensors, split a fused
gate|up projection, place a projection in some columns of a fused one, fold constant
multipliers into a projection). Every parameter must
be filled exactly once with the expected shape; anything else is an error naming the tensor.
"""

import dataclasses
import json
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from safetensors import SafetensorError, safe_open

from jaxengine.models.config import ModelConfig, load_model_config
from jaxengine.models.hybrid import HybridLM

logger = logging.getLogger(__name__)

CONVERTED_PARAMS_DIR = "jaxengine_params"  # the Orbax checkpoint inside a converted model directory

Path_ = tuple[str | int, ...]


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
    targets: Callable[[re.Match, ModelConfig], list[Path_]]
    kind: str = "copy"
    columns: Callable[[re.Match, ModelConfig], tuple[int, int, np.ndarray | None]] | None = None
    scale: Callable[[re.Match, ModelConfig], np.ndarray] | None = None


def _layer(path: str) -> Callable[[re.Match, ModelConfig], list[Path_]]:
    """Target `layers/<N>/<path>`, with `{sub}` filled from the match and `{ffn}` the layer's
    feed-forward module ("mlp" or "moe")."""

    def targets(m: re.Match, cfg: ModelConfig) -> list[Path_]:
        i = int(m.group("layer"))
        spec = cfg.layers[i] if i < len(cfg.layers) else None
        ffn = spec.ffn if spec else "mlp"
        filled = path.format(ffn=ffn, shared="shared" if ffn == "moe" else "", **m.groupdict())
        return [("layers", i, *(p for p in filled.split("/") if p))]

    return targets


def _top(*path: str) -> Callable[[re.Match, ModelConfig], list[Path_]]:
    return lambda m, cfg: [tuple(path)]


def _split(*paths: str) -> Callable[[re.Match, ModelConfig], list[Path_]]:
    return lambda m, cfg: [t for p in paths for t in _layer(p)(m, cfg)]


_L = r"(?:model|backbone)\.layers\.(?P<layer>\d+)\."


def _conv_rules(prefix: str, mixer: str) -> list[Rule]:
    """A recurrent mixer's depthwise conv, `<layer>.<prefix>.weight` and `.bias`."""
    return [
        Rule(_L + prefix + r"\.weight$", _layer(f"{mixer}/conv_weight"), "conv"),
        Rule(_L + prefix + r"\.bias$", _layer(f"{mixer}/conv_bias")),
    ]


def _mamba_rules(prefix: str) -> list[Rule]:
    """A Mamba2 mixer's tensors, named `<layer>.<prefix>.<tensor>`."""
    p = _L + prefix + r"\."
    return [
        Rule(p + r"(?P<sub>in_proj|out_proj)\.weight$", _layer("mamba/{sub}/kernel"), "linear"),
        Rule(p + r"(?P<sub>in_proj|out_proj)\.bias$", _layer("mamba/{sub}/bias")),
        *_conv_rules(prefix + r"\.conv1d", "mamba"),
        Rule(p + r"(?P<p>dt_bias|A_log|D)$", _layer("mamba/{p}")),
        Rule(p + r"norm\.weight$", _layer("mamba/norm/weight")),
    ]


_MAMBA = _mamba_rules(r"(?:mamba|mixer)")


def _attn(prefix: str) -> list[Rule]:
    return [
        Rule(_L + prefix + r"\.(?P<sub>[qkvo]_proj)\.weight$", _layer("attention/{sub}/kernel"), "linear"),
        Rule(_L + prefix + r"\.(?P<sub>[qkvo]_proj)\.bias$", _layer("attention/{sub}/bias")),
    ]


def _mlp(prefix: str) -> list[Rule]:
    return [
        Rule(_L + prefix + r"\.(?P<sub>gate_proj|up_proj|down_proj)\.weight$", _layer("mlp/{sub}/kernel"), "linear"),
        Rule(_L + prefix + r"\.(?P<sub>gate_proj|up_proj|down_proj)\.bias$", _layer("mlp/{sub}/bias")),
    ]


def _norms(mixer_norm: str, ffn_norm: str) -> list[Rule]:
    return [
        Rule(_L + mixer_norm + r"\.weight$", _layer("mixer_norm/weight")),
        Rule(_L + ffn_norm + r"\.weight$", _layer("ffn_norm/weight")),
    ]


def _embed_and_head(embed: str, final_norm: str) -> list[Rule]:
    return [
        Rule(embed + r"$", _top("embed")),
        Rule(final_norm + r"$", _top("final_norm", "weight")),
        Rule(r"lm_head\.weight$", _top("lm_head", "kernel"), "linear"),
    ]


def _nemotron_norm(m: re.Match, cfg: ModelConfig) -> list[Path_]:
    i = int(m.group("layer"))
    spec = cfg.layers[i] if i < len(cfg.layers) else None
    return [("layers", i, "mixer_norm" if spec is None or spec.mixer else "ffn_norm", "weight")]


def _mup_vector(cfg: ModelConfig) -> np.ndarray:
    """Falcon-H1's multipliers of the Mamba2 input projection's outputs z | x | B | C | dt."""
    mamba, (z, x, b, c, dt) = cfg.mamba, cfg.mup.ssm
    gn = mamba.n_groups * mamba.state_size
    widths = (mamba.intermediate_size, mamba.intermediate_size, gn, gn, mamba.num_heads)
    return np.repeat(np.array([z, x, b, c, dt], np.float32), widths)


def _falcon_h1_scale(m: re.Match, cfg: ModelConfig) -> np.ndarray:
    """The muP multipliers Falcon-H1 applies around a projection (`MupMultipliers`), as the
    factor of its Hugging Face weight `[out, in]` or bias `[out]`: the output multiplier
    scales both, the input multiplier only the weight."""
    mup = cfg.mup
    proj, leaf = m.string.split(".")[-2:]
    out = {
        "in_proj": _mup_vector(cfg),
        "out_proj": mup.ssm_out,
        "k_proj": mup.key,
        "o_proj": mup.attention_out,
        "gate_proj": mup.mlp_gate,
        "down_proj": mup.mlp_down,
    }.get(proj, 1.0)
    inp = {
        "in_proj": mup.ssm_in,
        "q_proj": mup.attention_in,
        "k_proj": mup.attention_in,
        "v_proj": mup.attention_in,
    }.get(proj, 1.0)
    out = np.asarray(out, np.float32)
    return out.reshape(-1, 1) * np.float32(inp) if leaf == "weight" else out


def _shared_block(path: str) -> Callable[[re.Match, ModelConfig], list[Path_]]:
    """Target `shared_blocks/<B>/<path>`, B the shared block layer N uses (Zamba2 stores each
    block once, under the first layer that uses it)."""

    def targets(m: re.Match, cfg: ModelConfig) -> list[Path_]:
        i = int(m.group("layer"))
        block = cfg.layers[i].shared_block if i < len(cfg.layers) else None
        filled = path.format(**m.groupdict())
        return [("shared_blocks", -1 if block is None else block, *filled.split("/"))]

    return targets


def _block_use(path: str) -> Callable[[re.Match, ModelConfig], list[Path_]]:
    """Target `layers/<N>/shared_use/<path>`, N the layer of the adapters' use (the `use`-th
    layer that runs a shared block)."""

    def targets(m: re.Match, cfg: ModelConfig) -> list[Path_]:
        users = [i for i, spec in enumerate(cfg.layers) if spec.shared_block is not None]
        use = int(m.group("use"))
        filled = path.format(**{**m.groupdict(), "half": "down" if m.group("half") == "0" else "up"})
        return [("layers", users[use] if use < len(users) else -1, "shared_use", *filled.split("/"))]

    return targets


def _jamba_rules() -> list[Rule]:
    m, ff = _L + r"mamba\.", _L + r"feed_forward\."
    return [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
        *_norms("input_layernorm", "pre_ff_layernorm"),
        *_attn("self_attn"),
        Rule(m + r"(?P<sub>in_proj|x_proj|dt_proj|out_proj)\.weight$", _layer("mamba1/{sub}/kernel"), "linear"),
        Rule(m + r"(?P<sub>in_proj|dt_proj|out_proj)\.bias$", _layer("mamba1/{sub}/bias")),
        *_conv_rules(r"mamba\.conv1d", "mamba1"),
        Rule(m + r"(?P<p>A_log|D)$", _layer("mamba1/{p}")),
        Rule(m + r"(?P<norm>dt|b|c)_layernorm\.weight$", _layer("mamba1/{norm}_norm/weight")),
        *_mlp("feed_forward"),
        Rule(ff + r"router\.weight$", _layer("moe/router"), "linear"),
        Rule(ff + r"experts\.gate_up_proj$", _layer("moe/experts_up"), "experts"),
        Rule(ff + r"experts\.down_proj$", _layer("moe/experts_down"), "experts"),
        Rule(
            ff + r"experts\.(?P<expert>\d+)\.(?P<half>gate|up)_proj\.weight$",
            _layer("moe/experts_up"),
            "columns",
            _expert_half,
        ),
        Rule(ff + r"experts\.(?P<expert>\d+)\.down_proj\.weight$", _layer("moe/experts_down"), "expert"),
    ]


def _zamba2_rules() -> list[Rule]:
    st = _L + r"shared_transformer\."
    return [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
        Rule(_L + r"(?:mamba_decoder\.)?input_layernorm\.weight$", _layer("mixer_norm/weight")),
        *_mamba_rules(r"(?:mamba_decoder\.)?mamba"),
        Rule(_L + r"linear\.weight$", _layer("shared_use/proj/kernel"), "linear"),
        Rule(st + r"input_layernorm\.weight$", _shared_block("input_norm/weight")),
        Rule(st + r"pre_ff_layernorm\.weight$", _shared_block("ffn_norm/weight")),
        Rule(st + r"self_attn\.(?P<sub>[qkvo]_proj)\.weight$", _shared_block("attention/{sub}/kernel"), "linear"),
        Rule(
            st + r"feed_forward\.gate_up_proj\.weight$",
            lambda m, cfg: [
                *_shared_block("mlp/gate_proj/kernel")(m, cfg),
                *_shared_block("mlp/up_proj/kernel")(m, cfg),
            ],
            "split",
        ),
        Rule(
            st + r"feed_forward\.gate_up_proj\.bias$",
            lambda m, cfg: [*_shared_block("mlp/gate_proj/bias")(m, cfg), *_shared_block("mlp/up_proj/bias")(m, cfg)],
            "split",
        ),
        Rule(st + r"feed_forward\.down_proj\.weight$", _shared_block("mlp/down_proj/kernel"), "linear"),
        Rule(st + r"feed_forward\.down_proj\.bias$", _shared_block("mlp/down_proj/bias")),
        Rule(
            st + r"self_attn\.linear_(?P<p>[qkv])_adapter_list\.(?P<use>\d+)\.(?P<half>[01])\.weight$",
            _block_use("{p}/{half}/kernel"),
            "linear",
        ),
        Rule(
            st + r"feed_forward\.gate_up_proj_adapter_list\.(?P<use>\d+)\.(?P<half>[01])\.weight$",
            _block_use("gate_up/{half}/kernel"),
            "linear",
        ),
    ]


def _scaled(rules: list[Rule], scale: Callable[[re.Match, ModelConfig], np.ndarray]) -> list[Rule]:
    return [dataclasses.replace(rule, scale=scale) for rule in rules]


_QWEN_L = r"model\.(?:language_model\.)?layers\.(?P<layer>\d+)\."


def _gated_delta_columns(m: re.Match, cfg: ModelConfig) -> tuple[int, int, np.ndarray | None]:
    """Where a Gated DeltaNet projection lies in our fused `in_proj` (columns q | k | v | z | b
    | a). Qwen3.5 stores the parts flat (`in_proj_qkv`, `_z`, `_b`, `_a`); Qwen3-Next stores
    `in_proj_qkvz` and `in_proj_ba` grouped per key head (rows q_g | k_g | v_g | z_g and
    b_g | a_g for each key head g), so their rows are reordered into the flat order."""
    g = cfg.gated_delta
    kd, vd, hv, dk = g.key_dim, g.value_dim, g.num_value_heads, g.key_head_dim
    ratio, dv = g.num_value_heads // g.num_key_heads, g.value_head_dim
    proj = m.group("proj")
    if proj == "qkvz":
        grouped = np.arange(g.num_key_heads * (2 * dk + 2 * ratio * dv)).reshape(g.num_key_heads, -1)
        cuts = np.cumsum([dk, dk, ratio * dv])
        return 0, 2 * kd + 2 * vd, np.concatenate([part.ravel() for part in np.split(grouped, cuts, axis=1)])
    if proj == "ba":
        grouped = np.arange(2 * hv).reshape(g.num_key_heads, 2 * ratio)
        return g.conv_dim + vd, 2 * hv, np.concatenate([grouped[:, :ratio].ravel(), grouped[:, ratio:].ravel()])
    start, width = {
        "qkv": (0, g.conv_dim),
        "z": (g.conv_dim, vd),
        "b": (g.conv_dim + vd, hv),
        "a": (g.conv_dim + vd + hv, hv),
    }[proj]
    return start, width, None


def _expert_half(m: re.Match, cfg: ModelConfig) -> tuple[int, int, None]:
    """A per-expert gate or up projection: the first or second half of our fused gate | up."""
    inner = cfg.moe.expert.intermediate_size
    return (0 if m.group("half") == "gate" else inner), inner, None


def _qwen_rules() -> list[Rule]:
    la = _QWEN_L + r"linear_attn\."
    return [
        *_embed_and_head(
            r"model\.(?:language_model\.)?embed_tokens\.weight", r"model\.(?:language_model\.)?norm\.weight"
        ),
        Rule(_QWEN_L + r"input_layernorm\.weight$", _layer("mixer_norm/weight")),
        Rule(_QWEN_L + r"post_attention_layernorm\.weight$", _layer("ffn_norm/weight")),
        Rule(_QWEN_L + r"self_attn\.(?P<sub>[qkvo]_proj)\.weight$", _layer("attention/{sub}/kernel"), "linear"),
        Rule(_QWEN_L + r"self_attn\.(?P<sub>[qkvo]_proj)\.bias$", _layer("attention/{sub}/bias")),
        Rule(_QWEN_L + r"self_attn\.(?P<sub>[qk]_norm)\.weight$", _layer("attention/{sub}/weight")),
        Rule(
            la + r"in_proj_(?P<proj>qkvz|ba|qkv|z|b|a)\.weight$",
            _layer("gated_delta/in_proj/kernel"),
            "columns",
            _gated_delta_columns,
        ),
        Rule(la + r"conv1d\.weight$", _layer("gated_delta/conv_weight"), "conv"),
        Rule(la + r"(?P<p>dt_bias|A_log)$", _layer("gated_delta/{p}")),
        Rule(la + r"norm\.weight$", _layer("gated_delta/norm/weight")),
        Rule(la + r"out_proj\.weight$", _layer("gated_delta/out_proj/kernel"), "linear"),
        Rule(_QWEN_L + r"mlp\.(?P<sub>gate_proj|up_proj|down_proj)\.weight$", _layer("mlp/{sub}/kernel"), "linear"),
        Rule(_QWEN_L + r"mlp\.gate\.weight$", _layer("moe/router"), "linear"),
        Rule(_QWEN_L + r"mlp\.experts\.gate_up_proj$", _layer("moe/experts_up"), "experts"),
        Rule(_QWEN_L + r"mlp\.experts\.down_proj$", _layer("moe/experts_down"), "experts"),
        Rule(
            _QWEN_L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<half>gate|up)_proj\.weight$",
            _layer("moe/experts_up"),
            "columns",
            _expert_half,
        ),
        Rule(_QWEN_L + r"mlp\.experts\.(?P<expert>\d+)\.down_proj\.weight$", _layer("moe/experts_down"), "expert"),
        Rule(
            _QWEN_L + r"mlp\.shared_expert\.(?P<sub>gate_proj|up_proj|down_proj)\.weight$",
            _layer("moe/shared/{sub}/kernel"),
            "linear",
        ),
        Rule(_QWEN_L + r"mlp\.shared_expert_gate\.weight$", _layer("moe/shared_gate"), "linear"),
    ]


RULES: dict[str, list[Rule]] = {
    "LlamaForCausalLM": [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.norm\.weight"),
        *_norms("input_layernorm", "post_attention_layernorm"),
        *_attn("self_attn"),
        *_mlp("mlp"),
    ],
    "Mamba2ForCausalLM": [
        *_embed_and_head(r"backbone\.embeddings?\.weight", r"backbone\.norm_f\.weight"),
        Rule(_L + r"norm\.weight$", _layer("mixer_norm/weight")),
        *_MAMBA,
    ],
    "BambaForCausalLM": [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
        *_norms("input_layernorm", "pre_ff_layernorm"),
        *_attn("self_attn"),
        *_MAMBA,
        *_mlp("feed_forward"),
    ],
    "GraniteMoeHybridForCausalLM": [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.norm\.weight"),
        *_norms("input_layernorm", "post_attention_layernorm"),
        *_attn("self_attn"),
        *_MAMBA,
        Rule(_L + r"block_sparse_moe\.router\.(?:layer\.)?weight$", _layer("moe/router"), "linear"),
        Rule(
            _L + r"block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)$",
            _layer("moe/experts_up"),
            "experts",
        ),
        Rule(
            _L + r"block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)$",
            _layer("moe/experts_down"),
            "experts",
        ),
        Rule(
            _L + r"shared_mlp\.input_linear\.weight$",
            _split("{ffn}/{shared}/gate_proj/kernel", "{ffn}/{shared}/up_proj/kernel"),
            "split",
        ),
        Rule(_L + r"shared_mlp\.output_linear\.weight$", _layer("{ffn}/{shared}/down_proj/kernel"), "linear"),
    ],
    "NemotronHForCausalLM": [
        *_embed_and_head(r"(?:backbone|model)\.embeddings\.weight", r"(?:backbone|model)\.norm_f\.weight"),
        Rule(_L + r"norm\.weight$", _nemotron_norm),
        *_MAMBA,
        Rule(_L + r"mixer\.(?P<sub>[qkvo]_proj)\.weight$", _layer("attention/{sub}/kernel"), "linear"),
        Rule(_L + r"mixer\.(?P<sub>up_proj|down_proj)\.weight$", _layer("mlp/{sub}/kernel"), "linear"),
        Rule(_L + r"mixer\.gate\.weight$", _layer("moe/router"), "linear"),
        Rule(_L + r"mixer\.gate\.e_score_correction_bias$", _layer("moe/router_bias")),
        Rule(_L + r"mixer\.experts\.(?P<expert>\d+)\.up_proj\.weight$", _layer("moe/experts_up"), "expert"),
        Rule(_L + r"mixer\.experts\.(?P<expert>\d+)\.down_proj\.weight$", _layer("moe/experts_down"), "expert"),
        Rule(_L + r"mixer\.experts\.up_proj$", _layer("moe/experts_up"), "experts"),
        Rule(_L + r"mixer\.experts\.down_proj$", _layer("moe/experts_down"), "experts"),
        Rule(
            _L + r"mixer\.shared_experts\.(?P<sub>up_proj|down_proj)\.weight$",
            _layer("moe/shared/{sub}/kernel"),
            "linear",
        ),
    ],
    "Lfm2ForCausalLM": [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.embedding_norm\.weight"),
        *_norms("operator_norm", "ffn_norm"),
        Rule(_L + r"self_attn\.(?P<sub>[qkv])_proj\.weight$", _layer("attention/{sub}_proj/kernel"), "linear"),
        Rule(_L + r"self_attn\.out_proj\.weight$", _layer("attention/o_proj/kernel"), "linear"),
        Rule(_L + r"self_attn\.(?P<sub>[qk])_layernorm\.weight$", _layer("attention/{sub}_norm/weight")),
        Rule(_L + r"conv\.(?P<sub>in_proj|out_proj)\.weight$", _layer("short_conv/{sub}/kernel"), "linear"),
        Rule(_L + r"conv\.(?P<sub>in_proj|out_proj)\.bias$", _layer("short_conv/{sub}/bias")),
        *_conv_rules(r"conv\.conv", "short_conv"),
        Rule(_L + r"feed_forward\.w1\.weight$", _layer("mlp/gate_proj/kernel"), "linear"),
        Rule(_L + r"feed_forward\.w3\.weight$", _layer("mlp/up_proj/kernel"), "linear"),
        Rule(_L + r"feed_forward\.w2\.weight$", _layer("mlp/down_proj/kernel"), "linear"),
    ],
    "FalconH1ForCausalLM": [
        *_embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
        *_norms("input_layernorm", "pre_ff_layernorm"),
        *_scaled([*_attn("self_attn"), *_MAMBA, *_mlp("feed_forward")], _falcon_h1_scale),
    ],
    "Zamba2ForCausalLM": _zamba2_rules(),
    "JambaForCausalLM": _jamba_rules(),
    "Qwen3NextForCausalLM": _qwen_rules(),
    "Qwen3_5ForCausalLM": _qwen_rules(),
    "Qwen3_5MoeForCausalLM": _qwen_rules(),
}

# The multi-token-prediction module (`mtp.py`): its own tensors, and its decoder layers named
# as the model's own (`mtp.layers.<N>.` for `model.layers.<N>.`).
# Nemotron-H's names for the MTP module's input norms, input projection and final norm.
NEMOTRON_MTP_NAMES = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "final_layernorm": "norm"}

MTP_RULES = [
    Rule(r"^mtp\.(?:layers\.0\.eh_proj|fc)\.weight$", _top("mtp", "fc", "kernel"), "linear"),
    Rule(
        r"^mtp\.(?P<norm>pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight$",
        lambda m, cfg: [("mtp", m.group("norm"), "weight")],
    ),
    Rule(
        r"^mtp\.layers\.\d+\.(?P<norm>enorm|hnorm|final_layernorm)\.weight$",
        lambda m, cfg: [("mtp", NEMOTRON_MTP_NAMES[m.group("norm")], "weight")],
    ),
]

# Tensors a checkpoint may carry that serving its text model does not use: rotary tables,
# Falcon-H1's muP vector (computed from the config, as transformers does), the MTP module
# unless speculative decoding drafts with it, and a vision-language checkpoint's vision tower.
IGNORED = re.compile(r"(rotary_emb\.inv_freq|mamba\.mup_vector|^mtp\.|^model\.visual\.)")


def _hf_shape(kind: str, ours: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape that converts into a parameter of shape `ours`."""
    if kind == "linear":
        return ours[::-1]
    if kind == "conv":
        return (ours[0], 1, ours[1])
    if kind == "experts":
        return (ours[0], ours[2], ours[1])
    if kind == "expert":
        return (ours[2], ours[1])
    if kind == "split":  # a weight, or a bias
        return (2 * ours[1], ours[0]) if len(ours) == 2 else (2 * ours[0],)
    return ours


def _convert(kind: str, tensor: np.ndarray) -> list[np.ndarray]:
    if kind in ("linear", "expert"):
        return [tensor.T]
    if kind == "conv":
        return [tensor[:, 0, :]]
    if kind == "experts":
        return [np.swapaxes(tensor, 1, 2)]
    if kind == "split":
        gate, up = np.split(tensor, 2, axis=0)
        return [gate.T, up.T]
    return [tensor]


def _read_safetensors(model_dir: Path) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of a single-file or sharded safetensors checkpoint, one at a time as host
    (numpy) arrays, so converting a checkpoint holds one raw tensor beside the converted ones;
    a ValueError naming the file for a broken file, and naming the tensor for one holding NaN
    or infinity (such weights would turn every output into the same token silently)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{index}: not a safetensors index ({type(err).__name__}: {err})") from None
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")
    for name in files:
        for key, tensor in _file_tensors(model_dir / name):
            if np.issubdtype(tensor.dtype, np.floating) or tensor.dtype.name == "bfloat16":
                if not np.isfinite(tensor.astype(np.float32)).all():
                    raise ValueError(f"{model_dir}: tensor {key!r} holds NaN or infinite values")
            yield key, tensor


def _file_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """One safetensors file's tensors, one at a time; a ValueError naming the file if it is broken."""
    try:
        with safe_open(path, framework="numpy") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    except (OSError, SafetensorError, ValueError) as err:
        raise ValueError(f"{path}: cannot read the safetensors file ({err})") from None


def abstract_model(cfg: ModelConfig, dtype: jnp.dtype, kernels: str = "auto") -> HybridLM:
    """The model's structure with shapes and dtypes but no values."""
    return nnx.eval_shape(lambda: HybridLM(cfg, dtype=dtype, rngs=nnx.Rngs(0), kernels=kernels))


def params_from_hf(model_dir: Path, cfg: ModelConfig, abstract_state: nnx.State) -> dict:
    """Reads and converts a Hugging Face checkpoint into a pure dict shaped like the model state."""
    expected = {path: leaf for path, leaf in _flat(abstract_state.to_pure_dict())}
    rules = RULES[cfg.architecture]
    filled: dict[Path_, np.ndarray] = {}
    # Parameters assembled from several tensors: (expert or None, first column) -> [in, width].
    parts: dict[Path_, dict[tuple[int | None, int], np.ndarray]] = {}
    ignored: dict[str, int] = {}
    for name, tensor in _read_safetensors(model_dir):
        rule, match, targets = _rule_for(name, cfg, rules)
        if rule is None:
            if found := IGNORED.search(name):
                ignored[found.group(0)] = ignored.get(found.group(0), 0) + 1
                continue
            raise ValueError(f"{model_dir}: unexpected tensor {name!r} with shape {tuple(tensor.shape)}")
        if targets == [("lm_head", "kernel")] and cfg.tie_word_embeddings:
            continue  # tied: the embedding serves as the output projection
        for path in targets:
            if path not in expected:
                raise ValueError(f"{model_dir}: unexpected tensor {name!r} (no parameter {'/'.join(map(str, path))})")
        expert = int(match.group("expert")) if "expert" in match.groupdict() else None
        if rule.kind == "columns":
            start, width, perm = rule.columns(match, cfg)
            want = (width, expected[targets[0]].shape[-2])
        else:
            want = _hf_shape(rule.kind, tuple(expected[targets[0]].shape))
        if tuple(tensor.shape) != want:
            raise ValueError(f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")
        if rule.scale is not None:
            tensor = tensor.astype(np.float32) * rule.scale(match, cfg)
        if rule.kind == "columns":
            parts.setdefault(targets[0], {})[(expert, start)] = (tensor if perm is None else tensor[perm]).T
            continue
        for path, value in zip(targets, _convert(rule.kind, tensor)):
            if rule.kind == "expert":
                parts.setdefault(path, {})[(expert, 0)] = value
            else:
                filled[path] = value
    for found, count in ignored.items():
        if found == "mtp.":
            logger.info(
                "%s: %d tensors mtp.* not loaded (the MTP draft module: speculative_config method 'mtp' uses it)",
                model_dir,
                count,
            )
        elif found not in ("rotary_emb.inv_freq", "mamba.mup_vector"):
            logger.info("%s: %d tensors %s* not loaded (not used to serve the text model)", model_dir, count, found)
    for path, pieces in parts.items():
        filled[path] = _assemble(model_dir, path, pieces, tuple(expected[path].shape))
    missing = [p for p in expected if p not in filled]
    if missing:
        names = ", ".join("/".join(map(str, p)) for p in missing[:8])
        raise ValueError(f"{model_dir}: missing tensors for parameters {names}" + (" ..." if len(missing) > 8 else ""))
    # Host arrays in the model's dtype, each converted as the one before it is let go; the
    # engine puts each straight into its shards on the device mesh.
    return _unflat({p: np.asarray(filled.pop(p), dtype=expected[p].dtype) for p in list(filled)})


def _rule_for(name: str, cfg: ModelConfig, rules: list[Rule]) -> tuple[Rule | None, re.Match | None, list[Path_]]:
    """The rule a tensor name matches, its match and its parameter paths; (None, None, [])
    for none. MTP tensors match only when the model has an MTP module: its layers by the
    architecture's own rules, as layers of a model made of the MTP layers."""
    if cfg.mtp_layers and name.startswith("mtp."):
        own = any(re.search(r.pattern, name) for r in MTP_RULES)
        if name.startswith("mtp.layers.") and not own:
            inner = "model." + name.removeprefix("mtp.")  # mtp.layers.N.x -> model.layers.N.x
            rule, match, targets = _rule_for(
                inner, dataclasses.replace(cfg, layers=cfg.mtp_layers, mtp_layers=()), rules
            )
            return rule, match, [("mtp", *t) for t in targets]
        rules = MTP_RULES
    rule, match = next(((r, m) for r in rules if (m := re.search(r.pattern, name))), (None, None))
    return rule, match, rule.targets(match, cfg) if rule else []


def _assemble(
    model_dir: Path, path: Path_, pieces: dict[tuple[int | None, int], np.ndarray], shape: tuple[int, ...]
) -> np.ndarray:
    """A parameter of `shape` from its column pieces, per expert if it is stacked; an error
    naming the parameter for missing experts or columns."""
    name = "/".join(map(str, path))
    stacked = next(iter(pieces))[0] is not None
    experts = sorted({e for e, _ in pieces}) if stacked else [None]
    if stacked and experts != list(range(shape[0])):
        missing = sorted(set(range(shape[0])) - set(experts))
        raise ValueError(f"{model_dir}: missing experts {missing} for parameter {name}")
    rows = []
    for e in experts:
        columns = sorted((start, value) for (pe, start), value in pieces.items() if pe == e)
        end = 0
        for start, value in columns:
            if start != end:
                raise ValueError(f"{model_dir}: missing columns [{end}, {start}) of parameter {name}")
            end += value.shape[-1]
        if end != shape[-1]:
            raise ValueError(f"{model_dir}: missing columns [{end}, {shape[-1]}) of parameter {name}")
        rows.append(np.concatenate([value for _, value in columns], axis=-1))
    return np.stack(rows) if stacked else rows[0]


def _flat(tree: dict, prefix: Path_ = ()) -> list[tuple[Path_, object]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out.extend(_flat(value, (*prefix, key)))
        else:
            out.append(((*prefix, key), value))
    return out


def _unflat(flat: dict[Path_, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


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
