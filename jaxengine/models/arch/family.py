"""An architecture family: what jaxengine needs to read one Hugging Face architecture."""

import dataclasses
from collections.abc import Callable, Sequence

from transformers import PretrainedConfig

from jaxengine.models.arch.hf_config import fail
from jaxengine.models.arch.mtp import MTP_RULES, with_mtp
from jaxengine.models.arch.rules import Rule
from jaxengine.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """An architecture's config mapping and tensor rules.

    `config` reads the Hugging Face config into a `ModelConfig` (without MTP layers), `rules`
    map the checkpoint's tensor names onto parameters (`rules.py`). `mtp` adds the MTP
    module's layers the config declares and `mtp_rules` read the module's own tensors; both
    default to the Qwen3-Next format (`mtp.py`). `config_class` reads config.json: None for
    transformers' `AutoConfig` (by its `model_type`), a `PretrainedConfig` subclass for an
    architecture transformers does not know.
    """

    config: Callable[[PretrainedConfig], ModelConfig]
    rules: Sequence[Rule]
    mtp: Callable[[ModelConfig, PretrainedConfig], ModelConfig] = with_mtp
    mtp_rules: Sequence[Rule] = MTP_RULES
    config_class: type[PretrainedConfig] | None = None


def text_model(text_architecture: str, text: Family) -> Family:
    """A vision-language checkpoint served as its text model (`text_config`, read as
    `text_architecture`); whether the output projection is tied is the outer config's say, as
    in transformers. The text family's rules read the checkpoint: the `ModelConfig` it gives
    is the text architecture's."""

    def read(hf: PretrainedConfig) -> ModelConfig:
        text_config = getattr(hf, "text_config", None)
        if text_config is None:
            fail(text_architecture, "text_config", None, "the text model's config")
        cfg = text.config(text_config)
        return dataclasses.replace(cfg, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))

    return dataclasses.replace(text, config=read, config_class=None)
