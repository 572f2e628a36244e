"""Zamba2: Mamba2 layers, some of which first run a shared transformer block
(`SharedBlockConfig`) and add its projected output to their input."""

import dataclasses
import math
import re

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import activation, attention_config, common_fields, fail
from jaxengine.models.arch.rules import LAYER, ParamPath, Rule, Targets, embed_and_head, layer, mamba_rules
from jaxengine.models.config import LayerSpec, MambaConfig, MlpConfig, ModelConfig, SharedBlockConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "Zamba2ForCausalLM"
    act = activation(hf, "hidden_act", arch, ("gelu", "silu"))
    table = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
    for t in hf.layers_block_type:
        if t not in table:
            fail(arch, "layers_block_type", t, ", ".join(table))
    if hf.use_shared_attention_adapter and hf.num_key_value_heads != hf.num_attention_heads:
        fail(
            arch,
            "num_key_value_heads",
            hf.num_key_value_heads,
            f"num_attention_heads={hf.num_attention_heads} (the attention adapters are as wide as the queries)",
        )
    layers, uses = [], 0
    for t in hf.layers_block_type:
        block = None
        if table[t] == "hybrid":
            block, uses = uses % hf.num_mem_blocks, uses + 1
        layers.append(LayerSpec("mamba", None, shared_block=block))
    head_dim = hf.attention_head_dim
    attention = attention_config(hf, arch, use_rope=bool(hf.use_mem_rope), head_dim=head_dim)
    mamba = MambaConfig(
        num_heads=hf.n_mamba_heads,
        head_dim=hf.mamba_headdim,
        state_size=hf.mamba_d_state,
        n_groups=hf.mamba_ngroups,
        conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.chunk_size,
        # As Nemotron-H's: the reference's chunked scan clamps at time_step_min.
        time_step_limit=(float(hf.time_step_min), math.inf),
        conv_bias=True,  # the reference always builds the conv with a bias
        proj_bias=bool(hf.add_bias_linear),
        out_proj_bias=bool(hf.add_bias_linear),
        norm_eps=1e-5,  # fixed in the reference, whatever rms_norm_eps says
    )
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(layers),
        rms_norm_eps=hf.rms_norm_eps,
        attention=dataclasses.replace(attention, bias=False, sm_scale=(head_dim / 2) ** -0.5),
        mamba=mamba,
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(hf.add_bias_linear)),
        moe=None,
        shared_block=SharedBlockConfig(
            min(hf.num_mem_blocks, uses), hf.adapter_rank, bool(hf.use_shared_attention_adapter)
        ),
    )


def _shared_block(path: str) -> Targets:
    """Target `shared_blocks/<B>/<path>`, B the shared block layer N uses (Zamba2 stores each
    block once, under the first layer that uses it)."""

    def targets(m: re.Match, cfg: ModelConfig) -> list[ParamPath]:
        i = int(m.group("layer"))
        block = cfg.layers[i].shared_block if i < len(cfg.layers) else None
        filled = path.format(**m.groupdict())
        return [("shared_blocks", -1 if block is None else block, *filled.split("/"))]

    return targets


def _block_use(path: str) -> Targets:
    """Target `layers/<N>/shared_use/<path>`, N the layer of the adapters' use (the `use`-th
    layer that runs a shared block)."""

    def targets(m: re.Match, cfg: ModelConfig) -> list[ParamPath]:
        users = [i for i, spec in enumerate(cfg.layers) if spec.shared_block is not None]
        use = int(m.group("use"))
        filled = path.format(**{**m.groupdict(), "half": "down" if m.group("half") == "0" else "up"})
        return [("layers", users[use] if use < len(users) else -1, "shared_use", *filled.split("/"))]

    return targets


_ST = LAYER + r"shared_transformer\."

RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
    Rule(LAYER + r"(?:mamba_decoder\.)?input_layernorm\.weight$", layer("mixer_norm/weight")),
    *mamba_rules(r"(?:mamba_decoder\.)?mamba"),
    Rule(LAYER + r"linear\.weight$", layer("shared_use/proj/kernel"), "linear"),
    Rule(_ST + r"input_layernorm\.weight$", _shared_block("input_norm/weight")),
    Rule(_ST + r"pre_ff_layernorm\.weight$", _shared_block("ffn_norm/weight")),
    Rule(_ST + r"self_attn\.(?P<sub>[qkvo]_proj)\.weight$", _shared_block("attention/{sub}/kernel"), "linear"),
    Rule(
        _ST + r"feed_forward\.gate_up_proj\.weight$",
        lambda m, cfg: [
            *_shared_block("mlp/gate_proj/kernel")(m, cfg),
            *_shared_block("mlp/up_proj/kernel")(m, cfg),
        ],
        "split",
    ),
    Rule(
        _ST + r"feed_forward\.gate_up_proj\.bias$",
        lambda m, cfg: [*_shared_block("mlp/gate_proj/bias")(m, cfg), *_shared_block("mlp/up_proj/bias")(m, cfg)],
        "split",
    ),
    Rule(_ST + r"feed_forward\.down_proj\.weight$", _shared_block("mlp/down_proj/kernel"), "linear"),
    Rule(_ST + r"feed_forward\.down_proj\.bias$", _shared_block("mlp/down_proj/bias")),
    Rule(
        _ST + r"self_attn\.linear_(?P<p>[qkv])_adapter_list\.(?P<use>\d+)\.(?P<half>[01])\.weight$",
        _block_use("{p}/{half}/kernel"),
        "linear",
    ),
    Rule(
        _ST + r"feed_forward\.gate_up_proj_adapter_list\.(?P<use>\d+)\.(?P<half>[01])\.weight$",
        _block_use("gate_up/{half}/kernel"),
        "linear",
    ),
]

ZAMBA2 = Family(config, RULES)
