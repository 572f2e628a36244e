"""Granite 4 (GraniteMoeHybrid): Mamba2 and attention layers, each with a MoE plus shared
expert or, without experts, the shared MLP alone; Granite's multipliers on the embedding,
the residual branches, attention scores and logits."""

import dataclasses

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import (
    activation,
    attention_config,
    bamba_like_mamba,
    common_fields,
    fail,
    layer_mixers,
)
from jaxengine.models.arch.rules import (
    LAYER,
    MAMBA,
    Rule,
    attention_rules,
    embed_and_head,
    layer,
    layer_paths,
    norm_rules,
)
from jaxengine.models.config import LayerSpec, MlpConfig, ModelConfig, MoeConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "GraniteMoeHybridForCausalLM"
    act = activation(hf, "hidden_act", arch, ("silu",))
    mixers = layer_mixers(list(hf.layer_types or ["linear_attention"] * hf.num_hidden_layers), arch, "layer_types")
    pos = getattr(hf, "position_embedding_type", None)
    if pos not in (None, "nope", "rope"):
        fail(arch, "position_embedding_type", pos, "null, 'nope', 'rope'")
    attention = attention_config(hf, arch, use_rope=pos == "rope")
    attention = dataclasses.replace(attention, sm_scale=float(hf.attention_multiplier))
    shared = MlpConfig(hf.shared_intermediate_size, act, gated=True, bias=False)
    moe = None
    if hf.num_local_experts > 0:
        expert = MlpConfig(hf.intermediate_size, act, gated=True, bias=False)
        moe = MoeConfig(hf.num_local_experts, hf.num_experts_per_tok, expert, shared, router="softmax_topk")
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec(m, "moe" if moe else "mlp") for m in mixers),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention,
        mamba=bamba_like_mamba(hf, arch),
        mlp=None if moe else shared,
        moe=moe,
        embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        logits_scaling=float(hf.logits_scaling),
    )


RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.norm\.weight"),
    *norm_rules("input_layernorm", "post_attention_layernorm"),
    *attention_rules("self_attn"),
    *MAMBA,
    Rule(LAYER + r"block_sparse_moe\.router\.(?:layer\.)?weight$", layer("moe/router"), "linear"),
    Rule(
        LAYER + r"block_sparse_moe\.(?:input_linear\.weight|experts\.gate_up_proj)$",
        layer("moe/experts_up"),
        "experts",
    ),
    Rule(
        LAYER + r"block_sparse_moe\.(?:output_linear\.weight|experts\.down_proj)$",
        layer("moe/experts_down"),
        "experts",
    ),
    # The shared MLP: the MoE's shared expert, or without experts the layer's MLP.
    Rule(
        LAYER + r"shared_mlp\.input_linear\.weight$",
        layer_paths("{ffn}/{shared}/gate_proj/kernel", "{ffn}/{shared}/up_proj/kernel"),
        "split",
    ),
    Rule(LAYER + r"shared_mlp\.output_linear\.weight$", layer("{ffn}/{shared}/down_proj/kernel"), "linear"),
]

GRANITE_MOE_HYBRID = Family(config, RULES)
