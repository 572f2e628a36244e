"""What the engine hands back to users, shaped as vLLM's `RequestOutput` / `CompletionOutput`."""

import dataclasses


@dataclasses.dataclass
class Logprob:
    """One token's log-probability under the model's raw distribution, its rank in that
    distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per output position: token id -> Logprob (the top-N tokens and the one chosen).
SampleLogprobs = list[dict[int, Logprob]]


@dataclasses.dataclass
class RequestMetrics:
    """Timings of one request, in seconds (perf_counter clock)."""

    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        if self.finish_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (num_output_tokens - 1)


@dataclasses.dataclass
class CompletionOutput:
    """One sample of a request (`SamplingParams.n` of them)."""

    index: int  # which of the request's n samples
    text: str | None  # None for a model without a tokenizer
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs (None unless logprobs were asked)
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" (eos, stop token or stop string), "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for eos)
    metrics: RequestMetrics | None = None  # jaxengine's: this sample's timings

    @property
    def time_to_first_token(self) -> float | None:
        return self.metrics.time_to_first_token if self.metrics else None

    @property
    def time_per_output_token(self) -> float | None:
        return self.metrics.time_per_output_token(len(self.token_ids)) if self.metrics else None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt: its samples in `outputs`."""

    request_id: str
    prompt: str | None  # the prompt's text when it was given as text
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None  # None first (the first token has none)
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: RequestMetrics | None = None  # of the first sample

    @property
    def time_to_first_token(self) -> float | None:
        """jaxengine's: seconds from arrival to the first sample's first token."""
        return self.outputs[0].time_to_first_token

    @property
    def time_per_output_token(self) -> float | None:
        """jaxengine's: mean seconds between the first sample's later tokens."""
        return self.outputs[0].time_per_output_token


@dataclasses.dataclass
class StreamOutput:
    """One increment of a streamed request: the tokens and text added since the last one."""

    index: int  # position among the prompts given
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output: RequestOutput | None = None  # the complete output, on the last increment
    sample: int = 0  # which of the request's n samples
    new_logprobs: SampleLogprobs | None = None  # the new tokens' entries, when logprobs were asked
