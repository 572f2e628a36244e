"""Bamba: Mamba2 and attention layers, each with a gated MLP."""

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import (
    activation,
    attention_config,
    bamba_like_mamba,
    common_fields,
    layer_mixers,
)
from jaxengine.models.arch.rules import MAMBA, attention_rules, embed_and_head, mlp_rules, norm_rules
from jaxengine.models.config import LayerSpec, MlpConfig, ModelConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "BambaForCausalLM"
    act = activation(hf, "hidden_act", arch, ("silu",))
    mixers = layer_mixers(list(hf.layers_block_type), arch, "attn_layer_indices")
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec(m, "mlp") for m in mixers),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention_config(hf, arch, use_rope=True),
        mamba=bamba_like_mamba(hf, arch),
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=None,
    )


RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
    *norm_rules("input_layernorm", "pre_ff_layernorm"),
    *attention_rules("self_attn"),
    *MAMBA,
    *mlp_rules("feed_forward"),
]

BAMBA = Family(config, RULES)
