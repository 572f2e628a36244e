"""vLLM's import path for the sampling types (`from vllm.sampling_params import SamplingParams`)."""

from jaxengine.engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
