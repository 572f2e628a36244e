"""Llama: attention and gated MLP layers."""

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import activation, attention_config, common_fields
from jaxengine.models.arch.rules import attention_rules, embed_and_head, mlp_rules, norm_rules
from jaxengine.models.config import LayerSpec, MlpConfig, ModelConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "LlamaForCausalLM"
    act = activation(hf, "hidden_act", arch, ("silu",))
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec("attention", "mlp") for _ in range(hf.num_hidden_layers)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention_config(hf, arch, use_rope=True),
        mamba=None,
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=None,
    )


RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.norm\.weight"),
    *norm_rules("input_layernorm", "post_attention_layernorm"),
    *attention_rules("self_attn"),
    *mlp_rules("mlp"),
]

LLAMA = Family(config, RULES)
