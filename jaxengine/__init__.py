"""jaxengine: a pure-JAX inference engine for hybrid attention + Mamba2 language models."""

from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.llm import LLM
from jaxengine.engine.outputs import RequestOutput, StreamOutput
from jaxengine.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "RequestOutput", "SamplingParams", "StreamOutput"]
