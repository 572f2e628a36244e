"""LFM2: short-convolution and attention layers (per-head q/k norm), each with a gated SiLU
MLP; the final norm is the one transformers calls `embedding_norm`."""

import dataclasses
import math

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import attention_config, common_fields, fail
from jaxengine.models.arch.rules import LAYER, Rule, conv_rules, embed_and_head, layer, norm_rules
from jaxengine.models.config import LayerSpec, MlpConfig, ModelConfig, ShortConvConfig


def _mlp_width(hf: PretrainedConfig) -> int:
    """LFM2's feed-forward width: `intermediate_size`, or with `block_auto_adjust_ff_dim` two
    thirds of it, times `block_ffn_dim_multiplier` and rounded up to `block_multiple_of`."""
    width = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if hf.block_ffn_dim_multiplier is not None:
            width = int(hf.block_ffn_dim_multiplier * width)
            width = hf.block_multiple_of * math.ceil(width / hf.block_multiple_of)
    return width


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "Lfm2ForCausalLM"
    table = {"conv": "short_conv", "full_attention": "attention"}
    for t in hf.layer_types:
        if t not in table:
            fail(arch, "layer_types", t, ", ".join(table))
    attention = dataclasses.replace(attention_config(hf, arch, use_rope=True), qk_norm=True)
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec(table[t], "mlp") for t in hf.layer_types),
        rms_norm_eps=hf.norm_eps,
        attention=attention if "full_attention" in hf.layer_types else None,
        mamba=None,
        mlp=MlpConfig(_mlp_width(hf), "silu", gated=True, bias=False),
        moe=None,
        short_conv=ShortConvConfig(hf.hidden_size, hf.conv_L_cache, bool(hf.conv_bias)),
    )


RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.embedding_norm\.weight"),
    *norm_rules("operator_norm", "ffn_norm"),
    Rule(LAYER + r"self_attn\.(?P<sub>[qkv])_proj\.weight$", layer("attention/{sub}_proj/kernel"), "linear"),
    Rule(LAYER + r"self_attn\.out_proj\.weight$", layer("attention/o_proj/kernel"), "linear"),
    Rule(LAYER + r"self_attn\.(?P<sub>[qk])_layernorm\.weight$", layer("attention/{sub}_norm/weight")),
    Rule(LAYER + r"conv\.(?P<sub>in_proj|out_proj)\.weight$", layer("short_conv/{sub}/kernel"), "linear"),
    Rule(LAYER + r"conv\.(?P<sub>in_proj|out_proj)\.bias$", layer("short_conv/{sub}/bias")),
    *conv_rules(r"conv\.conv", "short_conv"),
    Rule(LAYER + r"feed_forward\.w1\.weight$", layer("mlp/gate_proj/kernel"), "linear"),
    Rule(LAYER + r"feed_forward\.w3\.weight$", layer("mlp/up_proj/kernel"), "linear"),
    Rule(LAYER + r"feed_forward\.w2\.weight$", layer("mlp/down_proj/kernel"), "linear"),
]

LFM2 = Family(config, RULES)
