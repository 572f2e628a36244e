"""What the engine hands back to users."""

import dataclasses


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
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "stop" (eos, stop token or stop string), "length" (max_tokens)
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None  # per output token: token id -> log-probability
    metrics: RequestMetrics | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return self.metrics.time_to_first_token if self.metrics else None

    @property
    def time_per_output_token(self) -> float | None:
        return self.metrics.time_per_output_token(len(self.token_ids)) if self.metrics else None


@dataclasses.dataclass
class StreamOutput:
    """One increment of a streamed request: the tokens and text added since the last one."""

    index: int  # position among the prompts given
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    output: RequestOutput | None = None  # the complete output, on the last increment
