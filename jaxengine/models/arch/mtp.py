"""The multi-token-prediction (MTP) module in the Qwen3-Next format, which every family reads
unless it has its own (Nemotron-H): its layers from the config, its own tensors' rules.

The module (`mtp.py` of the model code) is `mtp.pre_fc_norm_embedding`,
`mtp.pre_fc_norm_hidden`, `mtp.fc`, decoder layers named as the model's own (`mtp.layers.<N>.`
for `model.layers.<N>.`, read by the family's rules) and `mtp.norm`.
"""

import dataclasses

from transformers import PretrainedConfig

from jaxengine.models.arch.hf_config import fail
from jaxengine.models.arch.rules import Rule, top
from jaxengine.models.config import LayerSpec, ModelConfig


def with_mtp(cfg: ModelConfig, hf: PretrainedConfig) -> ModelConfig:
    """Adds the MTP module's layers a config declares (`mtp_num_hidden_layers`, Qwen3-Next and
    Qwen3.5; jaxengine reads the same field for its other attention models): full-attention
    decoder layers of the model's own kind, with a MoE feed-forward where the model's
    layers have one."""
    n = getattr(hf, "mtp_num_hidden_layers", 0) or 0
    if not n:
        return cfg
    if cfg.attention is None:
        fail(
            cfg.architecture,
            "mtp_num_hidden_layers",
            n,
            "0 (jaxengine reads MTP modules of attention models in the Qwen3-Next format)",
        )
    if n != 1:
        fail(cfg.architecture, "mtp_num_hidden_layers", n, "1")
    ffn = "moe" if any(spec.ffn == "moe" for spec in cfg.layers) else "mlp"
    return dataclasses.replace(cfg, mtp_layers=(LayerSpec("attention", ffn),))


MTP_RULES = (
    Rule(r"^mtp\.fc\.weight$", top("mtp", "fc", "kernel"), "linear"),
    Rule(
        r"^mtp\.(?P<norm>pre_fc_norm_embedding|pre_fc_norm_hidden|norm)\.weight$",
        lambda m, cfg: [("mtp", m.group("norm"), "weight")],
    ),
)
