"""One request as the engine tracks it: its tokens, its cache resources and its progress."""

import dataclasses
import enum
import time

import numpy as np

from jaxengine.cache.prefix_cache import Checkpoint
from jaxengine.engine.list_mirror import Int32Mirror
from jaxengine.engine.outputs import Logprob
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.spec.state import SpecState
from jaxengine.engine.text_so_far import TextSoFar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    COMPLETING = "completing"  # finished, one step left to compute its last token (see Scheduler.finish)
    FINISHED = "finished"


@dataclasses.dataclass
class Sequence:
    """A request's state. `tokens` is prompt then output; the first `num_computed` of them
    are in the caches. When all are computed the next token is sampled and appended (once
    the host reads it: until then it counts in `num_tokens` only)."""

    request_id: str
    index: int  # position among the prompts of its `generate` call
    tokens: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    arrival_time: float = dataclasses.field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    cache_salt: str | None = None
    prompt: str | None = None  # the prompt's text, when given as text
    sample: int = 0  # which of its prompt's n samples
    # The prompt's other samples (on sample 0 only, with prefix caching): queued once this one
    # has prefilled the prompt, so they start from its cached pages and checkpoint.
    followers: list["Sequence"] = dataclasses.field(default_factory=list)
    bad_word_ids: list[list[int]] = dataclasses.field(default_factory=list)  # its bad_words, tokenized
    num_computed: int = 0
    pages: list[int] = dataclasses.field(default_factory=list)  # KV blocks of its page table
    # Recurrent state: the live slots it owns (two, plus one per draft position when
    # speculating); each step reads one and writes the others.
    owned_slots: list[int] = dataclasses.field(default_factory=list)
    read_slot: int = 0
    restore: Checkpoint | None = None  # the cached checkpoint its next step reads instead (a hit)
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of its full pages
    num_registered_pages: int = 0  # its leading pages already registered in the prefix cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    heat: int = 1  # hit count its checkpoints and pages start with (inherited from its hit)
    # Where known prefixes part along it beyond its hit (edge checkpoints), and the requests
    # that passed each (the checkpoint's starting hit count): see `prefix_shape`.
    junctions: dict[int, int] = dataclasses.field(default_factory=dict)
    prefill_boundary: int = 0  # the last page boundary of what its prefill covers (an edge checkpoint)
    # Its edge checkpoints (block hashes), superseded as it writes deeper ones on the same path,
    # and the one it continues from (a conversation's previous turn).
    hit_checkpoint: bytes | None = None
    prompt_checkpoint: bytes | None = None
    trailing_checkpoint: bytes | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    stop_text_cut: int | None = None  # characters of output text kept when a stop string matched
    text_so_far: TextSoFar | None = None  # its output's text while unfinished (streams look after each step)
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict[int, Logprob]] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = dataclasses.field(default_factory=lambda: [None])
    cumulative_logprob: float = 0.0  # of its chosen tokens (kept when logprobs are asked)
    spec: SpecState | None = None  # its speculation, in an engine that speculates
    matcher: object | None = None  # its grammar's llguidance matcher (structured outputs), at its tokens
    # An overlapped loop (`llm_engine.py`) runs the next step before the host reads the last
    # one's tokens: tokens sampled but not appended yet (0 or 1 when a step is scheduled), the
    # row of the step that sampled the last of them, and the checkpoint saves whose prefix
    # hash waits for them (`scheduler.CheckpointSave`).
    num_unfilled: int = 0
    feed_row: int = -1
    deferred_saves: list = dataclasses.field(default_factory=list)
    # `tokens` and `pages` as int32 arrays, extended as they grow: `token_array`, `page_row`.
    _token_mirror: Int32Mirror = dataclasses.field(default_factory=Int32Mirror, init=False, repr=False, compare=False)
    _page_mirror: Int32Mirror | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def token_array(self) -> np.ndarray:
        """`tokens` as an int32 array [len(tokens)] (a view, valid until the next call): only
        the tokens appended since the last call are converted (tokens are only ever appended)."""
        return self._token_mirror.of(self.tokens)

    def page_row(self, width: int) -> np.ndarray:
        """`pages` as its page table's row, an int32 array [width] zero-padded (a view, valid
        until the next call; `width` the same every call): only the pages added since the last
        call are converted (the scheduler extends the list, or replaces it whole)."""
        if self._page_mirror is None:
            self._page_mirror = Int32Mirror(width)
        return self._page_mirror.of(self.pages)

    @property
    def speculates(self) -> bool:
        """Whether it was admitted to speculate (drafts, and has the draft's state kept for it)."""
        return self.spec is not None and self.spec.speculates

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        """Its tokens, those sampled but not read yet included."""
        return len(self.tokens) + self.num_unfilled

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def num_sampled(self) -> int:
        """Its output tokens, those sampled but not read yet included."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def stops_for_length(self) -> bool:
        """Whether the tokens sampled so far, read or not, reach max_tokens: it ends there."""
        return self.num_sampled >= self.params.max_tokens

    @property
    def write_slot(self) -> int:
        """The owned slot its next step writes its final state to: the first it does not read."""
        return self.owned_slots[1] if self.read_slot == self.owned_slots[0] else self.owned_slots[0]

    @property
    def position_slots(self) -> list[int]:
        """Its other owned slots (when speculating): a verify step writes the state after its
        pending token and after each draft but the last to these, in order."""
        return [s for s in self.owned_slots if s not in (self.read_slot, self.write_slot)]
