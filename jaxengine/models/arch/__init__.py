"""The supported architectures: each Hugging Face architecture name's family, and reading a
model directory's config through it.

A family file (`llama.py`, `bamba.py`, ...) holds one family's config mapping and tensor
rules (`family.Family`); `ARCHITECTURES` names the families by the architectures
config.json lists, and `register` adds one from outside this package.
"""

import json
from pathlib import Path

from transformers import AutoConfig

from jaxengine.models.arch import (
    bamba,
    falcon_h1,
    granite_moe_hybrid,
    jamba,
    lfm2,
    llama,
    mamba2,
    nemotron_h,
    qwen_gated_delta,
    zamba2,
)
from jaxengine.models.arch.family import Family
from jaxengine.models.config import ModelConfig
from jaxengine.models.mixers import MIXERS

ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": llama.LLAMA,
    "Mamba2ForCausalLM": mamba2.MAMBA2,
    "BambaForCausalLM": bamba.BAMBA,
    "GraniteMoeHybridForCausalLM": granite_moe_hybrid.GRANITE_MOE_HYBRID,
    "NemotronHForCausalLM": nemotron_h.NEMOTRON_H,
    "Qwen3NextForCausalLM": qwen_gated_delta.QWEN3_NEXT,
    "Qwen3_5ForCausalLM": qwen_gated_delta.QWEN3_5,
    "Qwen3_5MoeForCausalLM": qwen_gated_delta.QWEN3_5_MOE,
    "Lfm2ForCausalLM": lfm2.LFM2,
    "FalconH1ForCausalLM": falcon_h1.FALCON_H1,
    "Zamba2ForCausalLM": zamba2.ZAMBA2,
    "JambaForCausalLM": jamba.JAMBA,
    "Qwen3_5ForConditionalGeneration": qwen_gated_delta.QWEN3_5_VL,
    "Qwen3_5MoeForConditionalGeneration": qwen_gated_delta.QWEN3_5_MOE_VL,
}


def register(architecture: str, family: Family) -> None:
    """Serves the checkpoints whose config.json lists `architecture` with `family`."""
    if architecture in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r} is already registered")
    ARCHITECTURES[architecture] = family


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Reads `config.json` from a Hugging Face model directory into a `ModelConfig`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object")
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"{path}: 'architectures' is missing; supported: {', '.join(ARCHITECTURES)}")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    family = ARCHITECTURES[architecture]
    hf = (family.config_class or AutoConfig).from_pretrained(str(model_dir))
    cfg = family.mtp(family.config(hf), getattr(hf, "text_config", None) or hf)
    _check_mixers(cfg)
    return cfg


def _check_mixers(cfg: ModelConfig) -> None:
    """Every mixer a family's mapping names is one the model code has (`mixers.py`)."""
    for where, specs in (("layer", cfg.layers), ("MTP layer", cfg.mtp_layers)):
        for i, spec in enumerate(specs):
            for mixer in spec.mixers:
                if mixer not in MIXERS:
                    raise ValueError(
                        f"{cfg.architecture}: {where} {i} has mixer {mixer!r}, which is not a mixer type of "
                        f"jaxengine/models/mixers.py; known: {', '.join(MIXERS)}"
                    )


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype `config.json` says the weights were saved in ("float32" when it says none,
    or one jaxengine does not compute in): what engine argument dtype="auto" means."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    saved = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return saved if saved in ("float32", "bfloat16", "float16") else "float32"
