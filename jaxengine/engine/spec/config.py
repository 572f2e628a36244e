"""The `speculative_config` engine argument (vLLM's names and defaults)."""

import dataclasses
from pathlib import Path

from jaxengine.models.config import ModelConfig

METHODS = ("ngram", "draft_model", "mtp")
DRAFTS_IN_STEP = ("mtp", "draft_model")  # methods whose drafts the model's step makes for the next one


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` fields that jaxengine reads."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    adaptive: bool = True  # jaxengine's: speculate only while it pays (`SpeculationGate`)
    model: str | None = None  # draft_model: the draft's directory

    @property
    def uses_mtp(self) -> bool:
        """Drafts with the model's own multi-token-prediction module."""
        return self.method == "mtp"

    @property
    def drafts_in_step(self) -> bool:
        """The model's step drafts for the next one (the MTP module or a draft model)."""
        return self.method in DRAFTS_IN_STEP

    def check_target(self, cfg: ModelConfig, model_dir: Path) -> None:
        """A ValueError naming the field where the model cannot serve this method."""
        if self.uses_mtp and not cfg.mtp_layers:
            raise ValueError(
                f"engine argument speculative_config.method='mtp': {model_dir / 'config.json'} "
                f"declares no MTP module (mtp_num_hidden_layers; Nemotron-H: num_nextn_predict_layers)"
            )

    @classmethod
    def parse(cls, raw: dict, max_num_batched_tokens: int) -> "SpeculativeConfig":
        """Reads the engine argument; a ValueError names the first bad field."""
        where = "engine argument speculative_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
        known = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "adaptive")
        for key in raw:
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r}; known: {', '.join(known)}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"{where}.method must be one of {', '.join(METHODS)}, got {method!r}")
        model = raw.get("model")
        if method == "draft_model" and not isinstance(model, str):
            raise ValueError(
                f"{where}.model must be the draft model's directory for method 'draft_model', got {model!r}"
            )
        if method != "draft_model" and model is not None:
            raise ValueError(f"{where}.model is only read by method 'draft_model', not {method!r}")
        k = raw.get("num_speculative_tokens")
        if not _is_positive_int(k):
            raise ValueError(f"{where}.num_speculative_tokens must be a positive integer, got {k!r}")
        if k + 1 > max_num_batched_tokens:
            raise ValueError(
                f"{where}.num_speculative_tokens={k}: a verify step of {k + 1} tokens exceeds "
                f"max_num_batched_tokens={max_num_batched_tokens}"
            )
        # vLLM's defaults: either bound alone sets both; neither gives 5.
        lookup_max, lookup_min = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        lookup_max = lookup_max if lookup_max is not None else (lookup_min if lookup_min is not None else 5)
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if not _is_positive_int(value):
                raise ValueError(f"{where}.{name} must be a positive integer, got {value!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"{where}: prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"{where}.adaptive must be true or false, got {adaptive!r}")
        return cls(method, k, lookup_max, lookup_min, adaptive, model)


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
