"""Falcon-H1: every layer runs Mamba2 and attention side by side on the same normed input,
then a gated MLP; muP multipliers throughout (`MupMultipliers`), folded into the projection
weights as they are read."""

import dataclasses
import re

import numpy as np
from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import (
    activation,
    attention_config,
    bamba_like_mamba,
    common_fields,
    fail,
)
from jaxengine.models.arch.rules import MAMBA, attention_rules, embed_and_head, mlp_rules, norm_rules, scaled
from jaxengine.models.config import LayerSpec, MlpConfig, ModelConfig, MupMultipliers


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "FalconH1ForCausalLM"
    act = activation(hf, "hidden_act", arch, ("silu",))
    for field, size in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        if len(getattr(hf, field)) != size:
            fail(arch, field, getattr(hf, field), f"a list of {size} numbers")
    mamba = bamba_like_mamba(hf, arch)
    if mamba.intermediate_size != hf.mamba_d_ssm and hf.mamba_d_ssm is not None:
        fail(arch, "mamba_n_heads * mamba_d_head", mamba.intermediate_size, f"mamba_d_ssm = {hf.mamba_d_ssm}")
    gated_norm = ("norm_first" if hf.mamba_norm_before_gate else "gate_first") if hf.mamba_rms_norm else "none"
    mamba = dataclasses.replace(mamba, out_proj_bias=bool(hf.projectors_bias), gated_norm=gated_norm)
    gate, down = (float(v) for v in hf.mlp_multipliers)
    mup = MupMultipliers(
        attention_in=float(hf.attention_in_multiplier),
        key=float(hf.key_multiplier),
        attention_out=float(hf.attention_out_multiplier),
        ssm_in=float(hf.ssm_in_multiplier),
        ssm=tuple(float(v) for v in hf.ssm_multipliers),
        ssm_out=float(hf.ssm_out_multiplier),
        mlp_gate=gate,
        mlp_down=down,
    )
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec("mamba", "mlp", parallel="attention") for _ in range(hf.num_hidden_layers)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention_config(hf, arch, use_rope=True),
        mamba=mamba,
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=None,
        embedding_multiplier=float(hf.embedding_multiplier),
        logits_scaling=1.0 / float(hf.lm_head_multiplier),
        mup=mup,
    )


def _mup_vector(cfg: ModelConfig) -> np.ndarray:
    """Falcon-H1's multipliers of the Mamba2 input projection's outputs z | x | B | C | dt."""
    mamba, (z, x, b, c, dt) = cfg.mamba, cfg.mup.ssm
    gn = mamba.n_groups * mamba.state_size
    widths = (mamba.intermediate_size, mamba.intermediate_size, gn, gn, mamba.num_heads)
    return np.repeat(np.array([z, x, b, c, dt], np.float32), widths)


def _scale(m: re.Match, cfg: ModelConfig) -> np.ndarray:
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


RULES = [
    *embed_and_head(r"model\.embed_tokens\.weight", r"model\.final_layernorm\.weight"),
    *norm_rules("input_layernorm", "pre_ff_layernorm"),
    *scaled([*attention_rules("self_attn"), *MAMBA, *mlp_rules("feed_forward")], _scale),
]

FALCON_H1 = Family(config, RULES)
