"""Nemotron-H: layers of one block each (Mamba2, attention without positional embedding,
squared-ReLU MLP, or a MoE of sigmoid group-limited routing), norm weights applied in
float32; its MTP module in its own format."""

import dataclasses
import math
import re

from transformers import PretrainedConfig

from jaxengine.models.arch.family import Family
from jaxengine.models.arch.hf_config import activation, attention_config, common_fields, fail
from jaxengine.models.arch.rules import LAYER, MAMBA, ParamPath, Rule, embed_and_head, layer, top
from jaxengine.models.config import LayerSpec, MambaConfig, MlpConfig, ModelConfig, MoeConfig


def config(hf: PretrainedConfig) -> ModelConfig:
    arch = "NemotronHForCausalLM"
    table = {
        "linear_attention": LayerSpec("mamba", None),
        "full_attention": LayerSpec("attention", None),
        "mlp": LayerSpec(None, "mlp"),
        "moe": LayerSpec(None, "moe"),
    }
    for t in hf.layers_block_type:
        if t not in table:
            fail(arch, "layers_block_type", t, ", ".join(table))
    layers = tuple(table[t] for t in hf.layers_block_type)
    mlp_act = activation(hf, "mlp_hidden_act", arch, ("relu2",))
    activation(hf, "mamba_hidden_act", arch, ("silu",))
    if getattr(hf, "moe_latent_size", None):
        fail(arch, "moe_latent_size", hf.moe_latent_size, "null")
    mamba = MambaConfig(
        num_heads=hf.mamba_num_heads,
        head_dim=hf.mamba_head_dim,
        state_size=hf.ssm_state_size,
        n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        # The reference implementation ignores `time_step_limit` and clamps at time_step_min.
        time_step_limit=(float(hf.time_step_min), math.inf),
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        out_proj_bias=bool(hf.use_bias),
    )
    moe = None
    if any(spec.ffn == "moe" for spec in layers):
        moe = MoeConfig(
            num_experts=hf.n_routed_experts,
            top_k=hf.num_experts_per_tok,
            expert=MlpConfig(hf.moe_intermediate_size, mlp_act, gated=False, bias=False),
            shared=MlpConfig(hf.moe_shared_expert_intermediate_size, mlp_act, gated=False, bias=False),
            router="sigmoid_grouped",
            n_group=hf.n_group,
            topk_group=hf.topk_group,
            norm_topk_prob=bool(hf.norm_topk_prob),
            routed_scaling_factor=float(hf.routed_scaling_factor),
        )
    attention = attention_config(hf, arch, use_rope=False, head_dim=hf.head_dim)
    return ModelConfig(
        **{**common_fields(hf, arch), "tie_word_embeddings": False},  # Nemotron-H never ties lm_head
        layers=layers,
        rms_norm_eps=hf.layer_norm_epsilon,
        attention=dataclasses.replace(attention, bias=False),
        mamba=mamba,
        mlp=MlpConfig(hf.intermediate_size, mlp_act, gated=False, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=moe,
        norm_weight_in_fp32=True,
    )


def with_mtp(cfg: ModelConfig, hf: PretrainedConfig) -> ModelConfig:
    """Nemotron-H's MTP layers (`num_nextn_predict_layers`, of the kinds `mtp_layers_block_type`
    lists): a full-attention layer, then feed-forward layers, each with its own norm."""
    n = getattr(hf, "num_nextn_predict_layers", 0) or 0
    if not n:
        return cfg
    if n != 1:
        fail(cfg.architecture, "num_nextn_predict_layers", n, "0 or 1")
    kinds = list(hf.mtp_layers_block_type)
    ffn_kinds = ("mlp", "moe") if cfg.moe is not None else ("mlp",)
    if not kinds or kinds[0] != "full_attention" or any(kind not in ffn_kinds for kind in kinds[1:]):
        fail(
            cfg.architecture,
            "mtp_layers_block_type",
            kinds,
            f"'full_attention' followed by any of {', '.join(map(repr, ffn_kinds))}",
        )
    layers = [LayerSpec("attention", None), *(LayerSpec(None, kind) for kind in kinds[1:])]
    return dataclasses.replace(cfg, mtp_layers=tuple(layers))


def _norm(m: re.Match, cfg: ModelConfig) -> list[ParamPath]:
    """A layer's one norm: before its mixer, or before its feed-forward in a feed-forward layer."""
    i = int(m.group("layer"))
    spec = cfg.layers[i] if i < len(cfg.layers) else None
    return [("layers", i, "mixer_norm" if spec is None or spec.mixer else "ffn_norm", "weight")]


RULES = [
    *embed_and_head(r"(?:backbone|model)\.embeddings\.weight", r"(?:backbone|model)\.norm_f\.weight"),
    Rule(LAYER + r"norm\.weight$", _norm),
    *MAMBA,
    Rule(LAYER + r"mixer\.(?P<sub>[qkvo]_proj)\.weight$", layer("attention/{sub}/kernel"), "linear"),
    Rule(LAYER + r"mixer\.(?P<sub>up_proj|down_proj)\.weight$", layer("mlp/{sub}/kernel"), "linear"),
    Rule(LAYER + r"mixer\.gate\.weight$", layer("moe/router"), "linear"),
    Rule(LAYER + r"mixer\.gate\.e_score_correction_bias$", layer("moe/router_bias")),
    Rule(LAYER + r"mixer\.experts\.(?P<expert>\d+)\.up_proj\.weight$", layer("moe/experts_up"), "expert"),
    Rule(LAYER + r"mixer\.experts\.(?P<expert>\d+)\.down_proj\.weight$", layer("moe/experts_down"), "expert"),
    Rule(LAYER + r"mixer\.experts\.up_proj$", layer("moe/experts_up"), "experts"),
    Rule(LAYER + r"mixer\.experts\.down_proj$", layer("moe/experts_down"), "experts"),
    Rule(
        LAYER + r"mixer\.shared_experts\.(?P<sub>up_proj|down_proj)\.weight$",
        layer("moe/shared/{sub}/kernel"),
        "linear",
    ),
]

# The MTP module's input norms, input projection and final norm, under Nemotron-H's names;
# its layers' own tensors are read by `RULES`.
MTP_NAMES = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "final_layernorm": "norm"}
MTP_RULES = [
    Rule(r"^mtp\.layers\.0\.eh_proj\.weight$", top("mtp", "fc", "kernel"), "linear"),
    Rule(
        r"^mtp\.layers\.\d+\.(?P<norm>enorm|hnorm|final_layernorm)\.weight$",
        lambda m, cfg: [("mtp", MTP_NAMES[m.group("norm")], "weight")],
    ),
]

NEMOTRON_H = Family(config, RULES, mtp=with_mtp, mtp_rules=MTP_RULES)
