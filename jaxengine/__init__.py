"""jaxengine: a pure-JAX inference engine for hybrid language models, with vLLM's offline API."""

from jaxengine.host_memory import tune_malloc_for_cpu

MALLOC_TUNED = tune_malloc_for_cpu()  # opt-in, before anything starts JAX's CPU backend; see host_memory.py

from jaxengine.quiet_imports import import_transformers_quietly  # noqa: E402

import_transformers_quietly()  # the engine reads configs and tokenizers with it, never models

from jaxengine.engine.engine_config import EngineConfig  # noqa: E402
from jaxengine.engine.llm import LLM  # noqa: E402
from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestOutput, StreamOutput  # noqa: E402
from jaxengine.engine.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from jaxengine.inputs import TextPrompt, TokensPrompt  # noqa: E402

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StreamOutput",
    "TextPrompt",
    "TokensPrompt",
]
