"""One request as the engine tracks it: its tokens, its cache resources and its progress."""

import dataclasses
import enum
import time

from jaxengine.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """A request's state. `tokens` is prompt then output; the first `num_computed` of them
    are in the caches. When all are computed the next token is sampled and appended."""

    request_id: str
    index: int  # position among the prompts of its `generate` call
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    cache_salt: str | None = None
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)
    # SSM state: the two live slots it owns, and the slot its next step reads (one of them, or
    # a pinned snapshot checkpoint after a prefix hit or once its own state became a checkpoint).
    owned_slots: list[int] = dataclasses.field(default_factory=list)
    read_slot: int = 0
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of its full pages
    num_registered_pages: int = 0  # its leading pages already registered in the page cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    junction: int = 0  # a cached-page boundary past the last checkpoint: a prefill chunk ends there
    prefill_boundary: int = 0  # the last page boundary of what its prefill covers: a chunk ends there
    hit_checkpoint: bytes | None = None  # the prefix checkpoint it resumed from, until it extends it
    trailing_checkpoint: int = 0  # its latest page-boundary checkpoint that nothing else keeps
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_text_cut: int | None = None  # characters of output text kept when a stop string matched
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def write_slot(self) -> int:
        """The owned slot its next step writes: whichever owned slot it does not read."""
        return self.owned_slots[1] if self.read_slot == self.owned_slots[0] else self.owned_slots[0]
