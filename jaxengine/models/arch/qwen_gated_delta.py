"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet and gated attention layers,
zero-centred norms; Qwen3.5's vision-language checkpoints served as their text model."""

import dataclasses
import re

import numpy as np
from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family, text_model
from jaxengine.models.arch.hf_config import activation, attention_config, common_fields, fail
from jaxengine.models.arch.rules import Rule, embed_and_head, expert_half, layer
from jaxengine.models.config import GatedDeltaConfig, LayerSpec, MlpConfig, ModelConfig, MoeConfig


def _config(hf: PretrainedConfig, arch: str) -> ModelConfig:
    """Text only: with the same position on its three axes, Qwen3.5's multimodal rotary
    embedding is the plain (partial) one."""
    act = activation(hf, "hidden_act", arch, ("silu",))
    table = {"linear_attention": "gated_delta", "full_attention": "attention"}
    for t in hf.layer_types:
        if t not in table:
            fail(arch, "layer_types", t, ", ".join(table))
    if hf.linear_num_value_heads % hf.linear_num_key_heads:
        fail(
            arch,
            "linear_num_value_heads",
            hf.linear_num_value_heads,
            f"a multiple of linear_num_key_heads={hf.linear_num_key_heads}",
        )
    gated_delta = GatedDeltaConfig(
        num_key_heads=hf.linear_num_key_heads,
        num_value_heads=hf.linear_num_value_heads,
        key_head_dim=hf.linear_key_head_dim,
        value_head_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
    )
    attention = dataclasses.replace(
        attention_config(hf, arch, use_rope=True), output_gate=True, qk_norm=True, qk_norm_offset=1.0
    )
    moe, moe_layers = None, set()
    num_experts = getattr(hf, "num_experts", 0) or 0
    if num_experts:
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=hf.num_experts_per_tok,
            expert=MlpConfig(hf.moe_intermediate_size, act, gated=True, bias=False),
            shared=MlpConfig(hf.shared_expert_intermediate_size, act, gated=True, bias=False),
            router="softmax",
            shared_gate=True,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),  # Qwen3.5-MoE always renormalises
        )
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf, "mlp_only_layers", None) or [])
        moe_layers = {i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0}
    intermediate = getattr(hf, "intermediate_size", None)
    mlp = MlpConfig(intermediate, act, gated=True, bias=False) if len(moe_layers) < hf.num_hidden_layers else None
    return ModelConfig(
        **common_fields(hf, arch),
        layers=tuple(LayerSpec(table[t], "moe" if i in moe_layers else "mlp") for i, t in enumerate(hf.layer_types)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention,
        mamba=None,
        mlp=mlp,
        moe=moe,
        gated_delta=gated_delta,
        norm_weight_offset=1.0,
    )


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


_L = r"model\.(?:language_model\.)?layers\.(?P<layer>\d+)\."  # a vision-language checkpoint's too
_LA = _L + r"linear_attn\."

RULES = [
    *embed_and_head(r"model\.(?:language_model\.)?embed_tokens\.weight", r"model\.(?:language_model\.)?norm\.weight"),
    Rule(_L + r"input_layernorm\.weight$", layer("mixer_norm/weight")),
    Rule(_L + r"post_attention_layernorm\.weight$", layer("ffn_norm/weight")),
    Rule(_L + r"self_attn\.(?P<sub>[qkvo]_proj)\.weight$", layer("attention/{sub}/kernel"), "linear"),
    Rule(_L + r"self_attn\.(?P<sub>[qkvo]_proj)\.bias$", layer("attention/{sub}/bias")),
    Rule(_L + r"self_attn\.(?P<sub>[qk]_norm)\.weight$", layer("attention/{sub}/weight")),
    Rule(
        _LA + r"in_proj_(?P<proj>qkvz|ba|qkv|z|b|a)\.weight$",
        layer("gated_delta/in_proj/kernel"),
        "columns",
        _gated_delta_columns,
    ),
    Rule(_LA + r"conv1d\.weight$", layer("gated_delta/conv_weight"), "conv"),
    Rule(_LA + r"(?P<p>dt_bias|A_log)$", layer("gated_delta/{p}")),
    Rule(_LA + r"norm\.weight$", layer("gated_delta/norm/weight")),
    Rule(_LA + r"out_proj\.weight$", layer("gated_delta/out_proj/kernel"), "linear"),
    Rule(_L + r"mlp\.(?P<sub>gate_proj|up_proj|down_proj)\.weight$", layer("mlp/{sub}/kernel"), "linear"),
    Rule(_L + r"mlp\.gate\.weight$", layer("moe/router"), "linear"),
    Rule(_L + r"mlp\.experts\.gate_up_proj$", layer("moe/experts_up"), "experts"),
    Rule(_L + r"mlp\.experts\.down_proj$", layer("moe/experts_down"), "experts"),
    Rule(
        _L + r"mlp\.experts\.(?P<expert>\d+)\.(?P<half>gate|up)_proj\.weight$",
        layer("moe/experts_up"),
        "columns",
        expert_half,
    ),
    Rule(_L + r"mlp\.experts\.(?P<expert>\d+)\.down_proj\.weight$", layer("moe/experts_down"), "expert"),
    Rule(
        _L + r"mlp\.shared_expert\.(?P<sub>gate_proj|up_proj|down_proj)\.weight$",
        layer("moe/shared/{sub}/kernel"),
        "linear",
    ),
    Rule(_L + r"mlp\.shared_expert_gate\.weight$", layer("moe/shared_gate"), "linear"),
]


def _family(arch: str) -> Family:
    return Family(lambda hf: _config(hf, arch), RULES)


QWEN3_NEXT = _family("Qwen3NextForCausalLM")
QWEN3_5 = _family("Qwen3_5ForCausalLM")
QWEN3_5_MOE = _family("Qwen3_5MoeForCausalLM")
QWEN3_5_VL = text_model("Qwen3_5ForCausalLM", QWEN3_5)
QWEN3_5_MOE_VL = text_model("Qwen3_5MoeForCausalLM", QWEN3_5_MOE)
