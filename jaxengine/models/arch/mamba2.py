"""Mamba2: Mamba2 (SSD) layers only, no feed-forward."""

import math

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import activation, common_fields, fail, time_step_limit
from jaxengine.models.arch.rules import LAYER, MAMBA, Rule, embed_and_head, layer
from jaxengine.models.config import LayerSpec, MambaConfig, ModelConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "Mamba2ForCausalLM"
    activation(hf, "hidden_act", arch, ("silu",))
    if hf.num_heads * hf.head_dim != hf.expand * hf.hidden_size:
        fail(
            arch,
            "num_heads * head_dim",
            hf.num_heads * hf.head_dim,
            f"expand * hidden_size = {hf.expand * hf.hidden_size}",
        )
    mamba = MambaConfig(
        num_heads=hf.num_heads,
        head_dim=hf.head_dim,
        state_size=hf.state_size,
        n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        time_step_limit=time_step_limit(hf.time_step_limit or (0.0, math.inf)),
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        out_proj_bias=bool(hf.use_bias),
    )
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec("mamba", None) for _ in range(hf.num_hidden_layers)),
        rms_norm_eps=hf.layer_norm_epsilon,
        attention=None,
        mamba=mamba,
        mlp=None,
        moe=None,
    )


RULES = [
    *embed_and_head(r"backbone\.embeddings?\.weight", r"backbone\.norm_f\.weight"),
    Rule(LAYER + r"norm\.weight$", layer("mixer_norm/weight")),
    *MAMBA,
]

MAMBA2 = Family(config, RULES)
