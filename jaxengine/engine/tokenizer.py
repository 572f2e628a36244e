"""Loading a model directory's tokenizer."""

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase | None:
    """The directory's Hugging Face tokenizer, or None when it ships no `tokenizer.json`
    (such a model then takes token-id prompts only)."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as err:  # tokenizers raises its own types for a broken file
        raise ValueError(f"{path}: cannot load the tokenizer ({type(err).__name__}: {err})") from None
