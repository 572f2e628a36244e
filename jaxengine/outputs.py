"""vLLM's import path for the output types (`from vllm.outputs import RequestOutput`)."""

from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestOutput, StreamOutput

__all__ = ["CompletionOutput", "Logprob", "RequestOutput", "StreamOutput"]
