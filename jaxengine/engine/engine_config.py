"""Engine arguments: sizes of the batch, the pools and the compiled shapes."""

import dataclasses
import math
from pathlib import Path

from jaxengine.models.config import ModelConfig

DEFAULT_COMPILATION_CACHE = Path("~/.cache/jaxengine/xla")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What `LLM(...)` and the YAML `engine:` section accept (names follow vLLM)."""

    dtype: str = "float32"
    max_model_len: int | None = None  # default: the model's max_position_embeddings, at most 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    page_size: int = 16
    num_kv_pages: int | None = None  # default: enough for max_num_seqs sequences of max_model_len
    kv_cache_memory_bytes: int | None = None  # alternative to num_kv_pages
    num_ssm_slots: int | None = None  # default: two per sequence, plus the null slot
    max_logprobs: int = 20
    kernels: str = "reference"
    compilation_cache_dir: str | None = str(DEFAULT_COMPILATION_CACHE)  # None: no persistent cache
    warm_up: bool = True
    seed: int = 0

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"engine argument {name} must be a positive integer, got {value!r}")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size", "num_kv_pages",
                     "kv_cache_memory_bytes", "num_ssm_slots", "max_logprobs"):
            positive(name)
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"engine argument dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.num_kv_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError("give num_kv_pages or kv_cache_memory_bytes, not both")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        return self.max_model_len or min(model.max_position_embeddings, 4096)

    def resolved_num_kv_pages(self, model: ModelConfig, dtype_bytes: int) -> int:
        """Pages in the KV pool, the null page included."""
        if self.num_kv_pages is not None:
            return self.num_kv_pages
        if self.kv_cache_memory_bytes is not None:
            a = model.attention
            per_page = 2 * self.page_size * a.num_kv_heads * a.head_dim * dtype_bytes * max(model.num_attention_layers, 1)
            return max(2, self.kv_cache_memory_bytes // per_page)
        return 1 + self.max_num_seqs * math.ceil(self.resolved_max_model_len(model) / self.page_size)

    def resolved_num_ssm_slots(self) -> int:
        """Slots in the SSM pool, the null slot included."""
        return self.num_ssm_slots if self.num_ssm_slots is not None else 1 + 2 * self.max_num_seqs
