"""Loading a model directory's tokenizer."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """The directory's Hugging Face tokenizer, or None when it ships no `tokenizer.json`
    (such a model then takes token-id prompts only)."""
    if not (model_dir / "tokenizer.json").is_file():
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))
