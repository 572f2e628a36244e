"""Engine arguments: sizes of the batch, the pools and the compiled shapes."""

import dataclasses
import math
from pathlib import Path

from jaxengine.models.config import ModelConfig
from jaxengine.models.kernels import KERNELS

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
    num_ssm_slots: int | None = None  # live SSM slots; default: two per sequence
    enable_prefix_caching: bool = True
    num_ssm_snapshot_slots: int | None = None  # checkpoint budget; default: four per sequence
    ssm_snapshot_memory_bytes: int | None = None  # alternative to num_ssm_snapshot_slots
    ssm_checkpoint_interval: int | None = None  # scan checkpoint spacing; default lcm(page, chunk)
    ssm_retention: str = "sparse"  # "dense", "sparse" or "every=N"
    ssm_eviction_alpha: float = 1.0  # weight of saved compute vs recency when evicting checkpoints
    max_logprobs: int = 20
    kernels: str = "auto"  # see jaxengine/models/kernels.py
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
                     "kv_cache_memory_bytes", "num_ssm_slots", "max_logprobs", "ssm_snapshot_memory_bytes",
                     "ssm_checkpoint_interval"):
            positive(name)
        if self.num_ssm_snapshot_slots is not None and (
            not isinstance(self.num_ssm_snapshot_slots, int) or self.num_ssm_snapshot_slots < 0
        ):
            raise ValueError(f"engine argument num_ssm_snapshot_slots must be an integer >= 0, got {self.num_ssm_snapshot_slots!r}")
        if self.num_ssm_snapshot_slots is not None and self.ssm_snapshot_memory_bytes is not None:
            raise ValueError("give num_ssm_snapshot_slots or ssm_snapshot_memory_bytes, not both")
        if not isinstance(self.ssm_eviction_alpha, (int, float)) or self.ssm_eviction_alpha < 0:
            raise ValueError(f"engine argument ssm_eviction_alpha must be >= 0, got {self.ssm_eviction_alpha!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"engine argument kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
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
        """Live SSM slots (running sequences' states)."""
        return self.num_ssm_slots if self.num_ssm_slots is not None else 2 * self.max_num_seqs

    def resolved_num_snapshots(self, model: ModelConfig) -> int:
        """Snapshot (checkpoint) slots."""
        if self.ssm_snapshot_memory_bytes is not None:
            m = model.mamba
            per_slot = model.num_mamba_layers * (
                4 * m.num_heads * m.head_dim * m.state_size + (4 if self.dtype == "float32" else 2) * m.conv_dim * m.conv_kernel
            )
            return self.ssm_snapshot_memory_bytes // per_slot
        return self.num_ssm_snapshot_slots if self.num_ssm_snapshot_slots is not None else 4 * self.max_num_seqs

    def resolved_checkpoint_interval(self, model: ModelConfig) -> int:
        """Scan checkpoint spacing: a multiple of the page size and of the scan's chunk size."""
        chunk = model.mamba.chunk_size
        interval = self.ssm_checkpoint_interval or math.lcm(self.page_size, chunk)
        if interval % self.page_size or interval % chunk:
            raise ValueError(
                f"ssm_checkpoint_interval={interval} must be a multiple of page_size={self.page_size} "
                f"and of the model's chunk size {chunk}"
            )
        return interval
