"""Engine arguments: sizes of the batch, the pools and the compiled shapes."""

import dataclasses
import math
from pathlib import Path

from jaxengine.cache import checkpoint_policy
from jaxengine.engine import vllm_args
from jaxengine.engine.mesh import Parallelism
from jaxengine.engine.pools import recurrent_block_elems
from jaxengine.engine.spec.config import SpeculativeConfig
from jaxengine.models.config import ModelConfig
from jaxengine.models.kernels import KERNELS

DEFAULT_COMPILATION_CACHE = Path("~/.cache/jaxengine/xla")


AUTO = "auto"  # prefix_cache_retention_interval left to the engine (see `resolved_retention_interval`)

# Engine arguments of earlier versions, and what replaced them.
REPLACED = {
    "ssm_retention": "prefix_cache_retention_interval (None = dense, 0 = sparse, N = a candidate every N tokens)",
    "ssm_checkpoint_interval": "prefix_cache_retention_interval",
    "num_kv_pages": "num_cache_blocks (KV pages and checkpoints share one pool of blocks)",
    "num_ssm_snapshot_slots": "num_cache_blocks or kv_cache_memory_bytes (KV pages and checkpoints share one pool)",
    "ssm_snapshot_memory_bytes": "kv_cache_memory_bytes (KV pages and checkpoints share one pool)",
    "ssm_eviction_alpha": "nothing: the prefix cache learns its eviction ranking online",
}


def check_engine_keys(keys, where: str = "engine argument") -> None:
    """Raises ValueError naming the first key `EngineConfig` does not take (and its
    replacement, if it was renamed)."""
    known = set(EngineConfig.__dataclass_fields__)
    for key in keys:
        if key in REPLACED:
            raise ValueError(f"{where} {key!r} was replaced by {REPLACED[key]}")
        if key not in known:
            also = ", ".join(vllm_args.known_names())
            raise ValueError(f"unknown {where} {key!r}; known: {', '.join(sorted(known))}; and vLLM's {also}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What `LLM(...)` and the YAML `engine:` section accept (names follow vLLM)."""

    dtype: str = "auto"  # "auto": the checkpoint's (config.json's dtype); "float32", "bfloat16", "float16"
    tokenizer: str | None = None  # a directory with tokenizer.json; default: the model's
    max_model_len: int | None = None  # default: the model's max_position_embeddings, at most 4096
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    page_size: int = 16
    # The cache pool: blocks of one KV page of every attention layer, shared by running
    # sequences' pages and by cached pages and checkpoints. Default: room for max_num_seqs
    # sequences of max_model_len, plus four checkpoints per sequence for recurrent models.
    num_cache_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # alternative to num_cache_blocks
    # vLLM's: the pool takes this fraction of the accelerator's memory, less what the weights
    # use (another alternative to num_cache_blocks; a CPU reports no memory limit: no effect).
    gpu_memory_utilization: float | None = None
    num_ssm_slots: int | None = None  # live recurrent-state slots; default: two per sequence
    enable_prefix_caching: bool = True
    # vLLM's knob: None = dense (a checkpoint candidate at every page boundary, and rungs:
    # `checkpoint_policy`), 0 = sparse (prompt ends, junctions and decode boundaries), N = a
    # candidate every N tokens (a multiple of page_size). "auto": dense for every model with
    # recurrent layers.
    prefix_cache_retention_interval: int | str | None = AUTO
    max_logprobs: int = 20
    kernels: str = "auto"  # see jaxengine/models/kernels.py
    compilation_cache_dir: str | None = str(DEFAULT_COMPILATION_CACHE)  # None: no persistent cache
    warm_up: bool = True
    # With warm_up: compile only the largest mixed and decode shapes before serving and the
    # others on a background thread (steps use a larger ready shape meanwhile); False: all first.
    background_compile: bool = True
    # vLLM's async scheduling: the host schedules and builds each step while the one before
    # runs, and reads that one's tokens after dispatching the next (`llm_engine.py`).
    async_scheduling: bool = True
    seed: int = 0
    # vLLM's speculative decoding settings, e.g. {"method": "ngram", "num_speculative_tokens": 3}
    # (`speculative.py`); None: no speculation.
    speculative_config: dict | None = None
    # Tensor parallelism: the model's heads, MLP columns, vocabulary and recurrent channels split
    # over this many devices (`mesh.py`); with enable_expert_parallel, a mixture's experts.
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # Data parallelism: this many replicas of the engine, each on its own tensor_parallel_size
    # devices with its own pools and prefix cache (`data_parallel.py`).
    data_parallel_size: int = 1
    # Many hosts (`multihost.py`): every process runs the same steps on its own devices of one
    # mesh; process 0 takes the requests. `distributed_init_addr` is process 0's "host:port",
    # `num_nodes` the number of processes, `node_rank` this one's; each process waits at most
    # `distributed_timeout_s` seconds for the others to join, or for one that stopped answering.
    distributed_init_addr: str | None = None
    num_nodes: int = 1
    node_rank: int = 0
    distributed_timeout_s: int = 300

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""

        def positive(name: str) -> None:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"engine argument {name} must be a positive integer, got {value!r}")

        for name in (
            "enable_prefix_caching",
            "warm_up",
            "background_compile",
            "enable_expert_parallel",
            "async_scheduling",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"engine argument {name} must be true or false, got {getattr(self, name)!r}")
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "page_size",
            "num_cache_blocks",
            "kv_cache_memory_bytes",
            "num_ssm_slots",
            "max_logprobs",
            "tensor_parallel_size",
            "data_parallel_size",
            "num_nodes",
            "distributed_timeout_s",
        ):
            positive(name)
        self._validate_hosts()
        sizes = [
            n
            for n in ("num_cache_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization")
            if getattr(self, n) is not None
        ]
        if len(sizes) > 1:
            raise ValueError(
                f"give one of num_cache_blocks, kv_cache_memory_bytes and gpu_memory_utilization, "
                f"not {' and '.join(sizes)}"
            )
        u = self.gpu_memory_utilization
        if u is not None and (not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1):
            raise ValueError(f"engine argument gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if self.prefix_cache_retention_interval != AUTO:
            try:
                checkpoint_policy.validate_interval(self.prefix_cache_retention_interval, self.page_size)
            except ValueError as err:
                raise ValueError(f"engine argument {err}") from None
        if self.kernels not in KERNELS:
            raise ValueError(f"engine argument kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"engine argument dtype must be one of auto, float32, bfloat16, float16 (or vLLM's "
                f"float, half), got {self.dtype!r}"
            )
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"engine argument tokenizer must be a directory path, got {self.tokenizer!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        self.speculative()

    def _validate_hosts(self) -> None:
        rank, nodes, addr = self.node_rank, self.num_nodes, self.distributed_init_addr
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < nodes:
            raise ValueError(f"engine argument node_rank must be an integer in [0, num_nodes={nodes}), got {rank!r}")
        if nodes == 1:
            if addr is not None:
                raise ValueError(f"engine argument distributed_init_addr={addr!r} needs num_nodes > 1")
            return
        host, _, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f'engine argument distributed_init_addr must be process 0\'s "host:port" when '
                f"num_nodes={nodes}, got {addr!r}"
            )
        if self.data_parallel_size != 1:
            raise ValueError(
                f"engine argument data_parallel_size={self.data_parallel_size} is not supported with "
                f"num_nodes={nodes} (one tensor-parallel engine spans the hosts)"
            )

    @property
    def parallelism(self) -> Parallelism:
        return Parallelism(self.tensor_parallel_size, self.enable_expert_parallel)

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed `speculative_config` (None without speculation)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config, self.max_num_batched_tokens)

    @property
    def num_speculative_tokens(self) -> int:
        spec = self.speculative()
        return spec.num_speculative_tokens if spec else 0

    @property
    def dtype_bytes(self) -> int:
        if self.dtype == "auto":
            raise RuntimeError("dtype 'auto' is resolved against the model before sizes are computed")
        return 4 if self.dtype == "float32" else 2

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        return self.max_model_len or min(model.max_position_embeddings, 4096)

    def check_model(self, model: ModelConfig, model_dir: Path) -> None:
        """A ValueError naming the engine argument that the model at `model_dir` cannot
        serve, before its weights load."""
        if self.dtype == "float16" and model.num_recurrent_layers:
            raise ValueError(
                "engine argument dtype='float16' is not supported for models with recurrent layers "
                "(their float32 states would not fit float16 checkpoints); use bfloat16 or float32"
            )
        max_model_len = self.resolved_max_model_len(model)
        if model.num_attention_layers and max_model_len > model.max_position_embeddings:
            raise ValueError(
                f"engine argument max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={model.max_position_embeddings} ({model_dir / 'config.json'})"
            )
        if self.max_logprobs > model.vocab_size:
            raise ValueError(
                f"engine argument max_logprobs={self.max_logprobs} exceeds the vocabulary ({model.vocab_size})"
            )
        spec = self.speculative()
        if spec is not None:
            spec.check_target(model, model_dir)

    def resolved_retention_interval(self, model: ModelConfig) -> tuple[int | None, str]:
        """The retention interval and why it was chosen (for the start-up log line)."""
        if self.prefix_cache_retention_interval != AUTO:
            return self.prefix_cache_retention_interval, "as given"
        if model.num_recurrent_layers:
            return checkpoint_policy.DENSE, "the default for models with recurrent layers"
        return checkpoint_policy.SPARSE, "the model has no recurrent layers, so there are no checkpoints"

    def block_bytes(self, model: ModelConfig, draft: ModelConfig | None = None) -> int:
        """Bytes of one cache block: one KV page of every attention layer and MTP layer (for
        a model without attention layers, one recurrent layer's checkpoint state), and the
        same of a draft model's (its pools lie in blocks of the same indices)."""
        if draft is not None:
            return self.block_bytes(model) + self.block_bytes(draft)
        if model.num_attention_layers:
            a = model.attention
            return 2 * self.page_size * a.num_kv_heads * a.head_dim * self.dtype_bytes * model.num_kv_layers
        return recurrent_block_elems(model, self.dtype) * self.dtype_bytes

    def resolved_num_cache_blocks(
        self, model: ModelConfig, blocks_per_checkpoint: int, draft: ModelConfig | None = None
    ) -> int:
        """Blocks in the cache pool, the null block included."""
        if self.num_cache_blocks is not None:
            return self.num_cache_blocks
        if self.kv_cache_memory_bytes is not None:
            return max(2, self.kv_cache_memory_bytes // self.block_bytes(model, draft))
        running = self.max_num_seqs * math.ceil(self.resolved_max_model_len(model) / self.page_size)
        if not model.num_attention_layers:
            running = 0
        return 1 + running + 4 * self.max_num_seqs * blocks_per_checkpoint

    def resolved_num_ssm_slots(self) -> int:
        """Live recurrent-state slots (running sequences' states): by default each sequence's
        read and write slots, and one per draft position when speculating."""
        if self.num_ssm_slots is not None:
            return self.num_ssm_slots
        return (2 + self.num_speculative_tokens) * self.max_num_seqs
