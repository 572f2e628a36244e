"""Jamba: Mamba-1 and attention (no positional embedding) layers by period and offset,
each with a gated MLP or, by their own period and offset, a MoE of softmax top-k routing
whose weights are not renormalised, without a shared expert."""

import math

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import activation, attention_config, common_fields, fail
from jaxengine.models.arch.rules import (
    LAYER,
    Rule,
    attention_rules,
    conv_rules,
    embed_and_head,
    expert_half,
    layer,
    mlp_rules,
    norm_rules,
)
from jaxengine.models.config import LayerSpec, Mamba1Config, MlpConfig, ModelConfig, MoeConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "JambaForCausalLM"
    act = activation(hf, "hidden_act", arch, ("silu",))
    for field in ("attn_layer_period", "expert_layer_period"):
        if getattr(hf, field) < 1:
            fail(arch, field, getattr(hf, field), "a positive period")
    mixers = ["attention" if kind == "attention" else "mamba1" for kind in hf.layers_block_type]
    moe_layers = [n > 1 for n in hf.layers_num_experts]
    rank = hf.mamba_dt_rank
    mamba1 = Mamba1Config(
        intermediate_size=hf.mamba_expand * hf.hidden_size,
        state_size=hf.mamba_d_state,
        conv_kernel=hf.mamba_d_conv,
        dt_rank=math.ceil(hf.hidden_size / 16) if rank == "auto" else int(rank),
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        bcdt_norms=True,
    )
    mlp = MlpConfig(hf.intermediate_size, act, gated=True, bias=False)
    moe = None
    if any(moe_layers):
        moe = MoeConfig(hf.num_experts, hf.num_experts_per_tok, mlp, None, router="softmax", norm_topk_prob=False)
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec(m, "moe" if e else "mlp") for m, e in zip(mixers, moe_layers)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention_config(hf, arch, use_rope=False) if "attention" in mixers else None,
        mamba=None,
        mlp=mlp if not all(moe_layers) else None,
        moe=moe,
        mamba1=mamba1,
    )


_M, _FF = LAYER + r"mamba\.", LAYER + r"feed_forward\."

RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
    *norm_rules("input_layernorm", "pre_ff_layernorm"),
    *attention_rules("self_attn"),
    Rule(_M + r"(?P<sub>in_proj|x_proj|dt_proj|out_proj)\.weight$", layer("mamba1/{sub}/kernel"), "linear"),
    Rule(_M + r"(?P<sub>in_proj|dt_proj|out_proj)\.bias$", layer("mamba1/{sub}/bias")),
    *conv_rules(r"mamba\.conv1d", "mamba1"),
    Rule(_M + r"(?P<p>A_log|D)$", layer("mamba1/{p}")),
    Rule(_M + r"(?P<norm>dt|b|c)_layernorm\.weight$", layer("mamba1/{norm}_norm/weight")),
    *mlp_rules("feed_forward"),
    Rule(_FF + r"router\.weight$", layer("moe/router"), "linear"),
    # The experts stacked, or one by one.
    Rule(_FF + r"experts\.gate_up_proj$", layer("moe/experts_up"), "experts"),
    Rule(_FF + r"experts\.down_proj$", layer("moe/experts_down"), "experts"),
    Rule(
        _FF + r"experts\.(?P<expert>\d+)\.(?P<half>gate|up)_proj\.weight$",
        layer("moe/experts_up"),
        "columns",
        expert_half,
    ),
    Rule(_FF + r"experts\.(?P<expert>\d+)\.down_proj\.weight$", layer("moe/experts_down"), "expert"),
]

JAMBA = Family(config, RULES)
