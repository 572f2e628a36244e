"""vLLM's `LLM(...)` keyword arguments that are not jaxengine engine fields, and what each
becomes here: an engine field under another name, a field value, or nothing (logged once)."""

import logging

logger = logging.getLogger("jaxengine")

ALIASES = {"block_size": "page_size"}

DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}

# Accepted whatever their value: they have no meaning in jaxengine.
NO_EFFECT = {
    "trust_remote_code": "models are read by jaxengine's own loader, never by code from the model directory",
    "disable_log_stats": "jaxengine logs no periodic statistics (llm.stats() returns them)",
    "swap_space": "a preempted sequence is recomputed, never swapped to host memory",
    "enable_chunked_prefill": "prefills are always chunked to max_num_batched_tokens",
    "max_seq_len_to_capture": "there are no CUDA graphs: every step shape is compiled",
    "disable_custom_all_reduce": "collectives are XLA's",
    "tokenizer_mode": "the tokenizer is always the directory's fast (tokenizers) one",
    "max_num_partial_prefills": "prefills are scheduled by the token budget",
}

# Accepted at the value that matches what jaxengine does; any other value is an error.
ONLY = {
    "pipeline_parallel_size": (1, "an engine splits the model over devices by tensor parallelism only"),
    "kv_cache_dtype": ("auto", "the KV cache has the model's dtype"),
    "quantization": (None, "quantized checkpoints are not supported"),
    "revision": (None, "models come from local directories"),
    "tokenizer_revision": (None, "tokenizers come from local directories"),
    "enable_lora": (False, "LoRA adapters are not supported"),
}

_logged: set[str] = set()


def known_names() -> list[str]:
    return sorted([*ALIASES, *NO_EFFECT, *ONLY, "enforce_eager"])


def translate(args: dict) -> dict:
    """vLLM-style keyword arguments -> EngineConfig fields. Engine fields pass through."""
    out = {}
    for key, value in args.items():
        if key in ALIASES:
            target = ALIASES[key]
            if target in args:
                raise ValueError(f"give engine argument {key!r} or {target!r}, not both")
            out[target] = value
        elif key == "enforce_eager":  # vLLM: no CUDA graphs; here: no compilation before serving
            if not isinstance(value, bool):
                raise ValueError(f"engine argument enforce_eager must be true or false, got {value!r}")
            if value:
                out["warm_up"] = False
        elif key in NO_EFFECT:
            _log_once(key, f"engine argument {key}={value!r} has no effect: {NO_EFFECT[key]}")
        elif key in ONLY:
            allowed, why = ONLY[key]
            if value != allowed or isinstance(value, bool) != isinstance(allowed, bool):
                raise ValueError(f"engine argument {key} must be {allowed!r} ({why}), got {value!r}")
        else:
            out[key] = value
    if "dtype" in out:
        dtype = out["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"engine argument dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        out["dtype"] = DTYPES[dtype]
    return out


def _log_once(key: str, message: str) -> None:
    if key not in _logged:
        _logged.add(key)
        logger.info(message)
