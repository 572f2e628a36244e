"""jaxengine: a pure-JAX inference engine for hybrid attention + Mamba2 language models."""

from jaxengine.engine.llm import LLM, RequestOutput
from jaxengine.engine.sampler import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
