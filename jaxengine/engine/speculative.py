"""Speculative decoding: the `speculative_config` engine argument, the ngram proposer, the
acceptance rule and the counters `stats()` reports. (The `mtp` method's drafts come from the
model's own step: `models/mtp.py`.)

A speculating sequence's step verifies its drafts: its pending token and its `d` draft tokens
go through the target model as one segment of `1 + d` tokens, the step samples a token after
each of them, and the host keeps the drafts the target agrees with plus the target's own next
token (`accept`). Each row is sampled exactly as a plain decode step would sample that output
position (same settings, same per-request key for that output index), so a draft is accepted
with the probability the target gives it and a rejection leaves the target's own draw: for a
deterministic draft (one token per position, as ngram's) this is the standard rejection rule
(accept with min(1, p/q), q one-hot; otherwise draw from the normalised max(0, p - q)), and
seeded outputs are the same tokens with and without speculation.

The `mtp` and `draft_model` methods draft inside the step (`models/mtp.py`,
`models/draft_chain.py`) for the step after, each draft chosen from the draft's logits as the
target will choose that output index: same settings, same key (`sampler.draft_tokens`). The
drafts are then deterministic given the key, and the rule above still holds for them (q is
one-hot given the noise); since the draft and the target share the Gumbel noise of each
draw, a draft whose distribution is near the target's draws the target's token with high
probability at any temperature (drafting greedily caps acceptance at the target's
probability of its top token).
"""

import collections
import dataclasses
import statistics

METHODS = ("ngram", "draft_model", "mtp")
DRAFTS_IN_STEP = ("mtp", "draft_model")  # methods whose drafts the model's step makes for the next one


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` fields that jaxengine reads."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    adaptive: bool = True  # jaxengine's: speculate only while it pays (`SpeculationGate`)
    model: str | None = None  # draft_model: the draft's directory

    @classmethod
    def parse(cls, raw: dict, max_num_batched_tokens: int) -> "SpeculativeConfig":
        """Reads the engine argument; a ValueError names the first bad field."""
        where = "engine argument speculative_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a mapping, got {type(raw).__name__}")
        known = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", "adaptive")
        for key in raw:
            if key not in known:
                raise ValueError(f"{where}: unknown key {key!r}; known: {', '.join(known)}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"{where}.method must be one of {', '.join(METHODS)}, got {method!r}")
        model = raw.get("model")
        if method == "draft_model" and not isinstance(model, str):
            raise ValueError(
                f"{where}.model must be the draft model's directory for method 'draft_model', got {model!r}"
            )
        if method != "draft_model" and model is not None:
            raise ValueError(f"{where}.model is only read by method 'draft_model', not {method!r}")
        k = raw.get("num_speculative_tokens")
        if not _is_positive_int(k):
            raise ValueError(f"{where}.num_speculative_tokens must be a positive integer, got {k!r}")
        if k + 1 > max_num_batched_tokens:
            raise ValueError(
                f"{where}.num_speculative_tokens={k}: a verify step of {k + 1} tokens exceeds "
                f"max_num_batched_tokens={max_num_batched_tokens}"
            )
        # vLLM's defaults: either bound alone sets both; neither gives 5.
        lookup_max, lookup_min = raw.get("prompt_lookup_max"), raw.get("prompt_lookup_min")
        lookup_max = lookup_max if lookup_max is not None else (lookup_min if lookup_min is not None else 5)
        lookup_min = lookup_min if lookup_min is not None else lookup_max
        for name, value in (("prompt_lookup_max", lookup_max), ("prompt_lookup_min", lookup_min)):
            if not _is_positive_int(value):
                raise ValueError(f"{where}.{name} must be a positive integer, got {value!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"{where}: prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"{where}.adaptive must be true or false, got {adaptive!r}")
        return cls(method, k, lookup_max, lookup_min, adaptive, model)


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class NgramIndex:
    """Prompt lookup over one sequence's tokens, which only grow: the latest start of every
    n-gram (`lookup_min` <= n <= `lookup_max`) that ends before the last token, brought up to
    date at each lookup with the tokens appended since the one before, so a lookup costs a few
    dictionary operations per new token and per n instead of a scan of the whole sequence."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self._starts: dict[tuple[int, ...], int] = {}  # n-gram -> its latest start
        self._num_ends = 0  # the n-grams ending at tokens[:_num_ends] are indexed

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The up to `k` tokens that followed the latest earlier occurrence of the longest
        suffix of `tokens` (between `lookup_min` and `lookup_max` tokens long); [] if none.
        `tokens` must extend those of the previous call."""
        last = len(tokens) - 1  # n-grams end before the last token
        for end in range(self._num_ends, last):
            for n in range(self.lookup_min, min(self.lookup_max, end + 1) + 1):
                self._starts[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self._num_ends = max(self._num_ends, last)
        if k < 1:
            return []
        for n in range(min(self.lookup_max, last), self.lookup_min - 1, -1):
            start = self._starts.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verify step emits: the drafts up to the first one the target's own draw
    disagrees with, then the target's draw there (after all drafts: its bonus token).
    `sampled[j]` is the target's token after the pending token and the first j drafts."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    return drafts[:n] + [sampled[n]]


@dataclasses.dataclass
class ProbeBackoff:
    """When to try again something that does not pay: every `wait`-th call of `due` says yes,
    each yes doubling the wait (from `first` up to `longest`) unless it could not try
    (`grow=False`); `reset` once it pays."""

    first: int
    longest: int
    count: int = 0  # calls since the last yes or reset
    wait: int = 0

    def __post_init__(self):
        self.wait = self.first

    def reset(self) -> None:
        self.count, self.wait = 0, self.first

    def due(self, commit: bool = True, grow: bool = True) -> bool:
        """Whether this call is a probe; `commit=False` only predicts it."""
        count = self.count + 1
        if count < self.wait:
            if commit:
                self.count = count
            return False
        if commit:
            self.count = 0
            if grow:
                self.wait = min(2 * self.wait, self.longest)
        return True


class SpeculationGate:
    """Decides whether drafting pays at the current batch size: step by step, and for the
    methods that draft inside the step (MTP, a draft model) also per request as it is admitted.

    It keeps, per sequence bucket S, the seconds of the last `window` decode steps and verify
    steps run (whole steps: scheduling, the device's work and the host's), and the mean tokens
    a verify step emits per drafting sequence (an exponential average; per bucket too, as the
    requests, and so the acceptance, differ between the times a workload runs at each). Times
    are taken as the median of their window, so one slow step (a pause of the host) does not
    decide for long; the engine does not hand it a shape's first step (an executable's first
    run is several times slower than its next ones, and each shape has one). Decode steps
    come in two kinds: those that do the method's own work for speculating sequences (the
    MTP module's pass over every token, the draft model's), the alternative to verifying for
    a sequence that speculates, and plain ones (no such work), the alternative to
    speculating at all.

    Step by step (`open`): a verify step pays when it emits more tokens per second than a
    decode step. A verify step costs the same however many of its S sequences draft, and
    emits one token per sequence plus the drafts kept, so with a share f of the sequences
    drafting it pays when 1 + f * (emitted - 1) >= t_verify / t_decode (emitted: per
    drafting sequence). (ngram's drafts are found on the host, before the step: the engine
    asks `may_open_next` with the share of sequences that may draft, and where it says yes,
    finds the drafts and opens with the share that have some.) Until both times are known it
    measures them (a decode step first, then verify steps). Both estimates stay fresh: while
    speculation pays, every `probe_every`-th step is a decode one (re-timing it); while it does
    not, a probe still verifies after `probe_every` steps off, so a change in acceptance or in
    the batch turns it back on, and each probe that finds it still not paying doubles the
    wait, up to `max_probe_every`. Each bucket counts its own steps on and off (a run's few
    steps at another batch size do not reset the wait). A probe due at a step in which no
    sequence has drafts verifies nothing and leaves the wait as it was: the next comes a
    wait later (ngram looks its drafts up only where the gate may open, so not every step).

    Per request (`admits`): whether a request admitted into a batch of S sequences speculates
    at all, against plain decode steps: until verify steps at S are timed, it does; then,
    until plain decode steps at S are timed, it does not; then it does where verify steps beat
    plain ones by `admit_margin` (what step times leave out: the method's pass over the
    request's prompt, the steps run plain to re-time, probes), and otherwise every `wait`-th
    admission still does (a probe), the wait doubling as above. A probe among S sequences
    makes every step of all S run the method's pass while it lasts, so at S the wait is S
    times as long (`probe_every` x S, up to `max_probe_every` x S): probing then costs about
    the same share of the work at any S."""

    def __init__(
        self,
        probe_every: int = 16,
        smoothing: float = 0.2,
        max_probe_every: int = 128,
        window: int = 5,
        admit_margin: float = 0.2,
    ):
        self.probe_every = probe_every
        self.admit_margin = admit_margin
        self.max_probe_every = max_probe_every
        self.smoothing = smoothing
        self.window = window
        # The last `window` step times per bucket: decode steps doing the method's work, plain ones, verify steps.
        self.decode_seconds: dict[int, collections.deque[float]] = {}
        self.plain_seconds: dict[int, collections.deque[float]] = {}
        self.verify_seconds: dict[int, collections.deque[float]] = {}
        self.emitted_per_seq: dict[int, float] = {}  # per bucket: tokens a verify step emits per drafting sequence
        self.steps_on: dict[int, int] = {}  # per bucket: steps since speculation last turned on
        self.steps_off: dict[int, ProbeBackoff] = {}  # per bucket: steps off, when the next verifies
        self.retiming = False  # the last `open` said no to re-time a decode step
        self.admissions_off: dict[int, ProbeBackoff] = {}  # per bucket: when the next turned-away request speculates

    def _verify_pays(self, num_seqs: int, decode: float, margin: float = 0.0, share: float = 1.0) -> bool:
        """Whether verify steps with a `share` of their sequences drafting emit `1 + margin`
        times the tokens per second of decode steps taking `decode` seconds."""
        emitted = 1 + share * (self.emitted_per_seq[num_seqs] - 1)  # per sequence
        return emitted * decode >= (1 + margin) * statistics.median(self.verify_seconds[num_seqs])

    def pays(self, num_seqs: int, share: float = 1.0) -> bool:
        """Whether verify steps of `num_seqs` sequences, a `share` of them drafting, pay
        (against decode steps that do the method's work, else plain ones), or are not timed yet."""
        decode = self.decode_seconds.get(num_seqs) or self.plain_seconds.get(num_seqs)
        if num_seqs not in self.verify_seconds or not decode:
            return True
        return self._verify_pays(num_seqs, statistics.median(decode), share=share)

    def admits(self, num_seqs: int) -> bool:
        """Whether a request admitted into a batch of `num_seqs` (bucketed) sequences speculates."""
        if num_seqs not in self.verify_seconds:
            return True
        if num_seqs not in self.plain_seconds:
            return False
        off = self.admissions_off.setdefault(
            num_seqs, ProbeBackoff(self.probe_every * num_seqs, self.max_probe_every * num_seqs)
        )
        if self._verify_pays(num_seqs, statistics.median(self.plain_seconds[num_seqs]), self.admit_margin):
            off.reset()
            return True
        return off.due()

    def open(self, num_seqs: int, share: float = 1.0) -> bool:
        """Whether the next step of `num_seqs` (bucketed) sequences, a `share` of them with
        drafts, should draft."""
        opened = self._decide(num_seqs, share, commit=True)
        self.retiming = not opened and self._timed(num_seqs) and self.pays(num_seqs, share)
        return opened

    def may_open_next(self, num_seqs: int, share: float = 1.0) -> bool:
        """What the next `open` of `num_seqs` will say, as far as known now (for drafts made a
        step ahead, as the MTP module's: steps that do not draft are the decode steps timed)."""
        return self._decide(num_seqs, share, commit=False)

    def _timed(self, num_seqs: int) -> bool:
        return num_seqs in self.decode_seconds or num_seqs in self.plain_seconds

    def _decide(self, num_seqs: int, share: float, commit: bool) -> bool:
        if not self._timed(num_seqs):
            return False
        off = self.steps_off.setdefault(num_seqs, ProbeBackoff(self.probe_every, self.max_probe_every))
        if share > 0 and self.pays(num_seqs, share):
            on = self.steps_on.get(num_seqs, 0) + 1
            if commit:
                self.steps_on[num_seqs] = on
                off.reset()
            return on % self.probe_every != 0
        probe = off.due(commit, grow=share > 0)
        if probe and commit:
            self.steps_on[num_seqs] = 0
        return probe and share > 0

    def record_decode(self, num_seqs: int, seconds: float, plain: bool = True) -> None:
        """A decode step's time; `plain`: it did none of the method's work."""
        times = self.plain_seconds if plain else self.decode_seconds
        times.setdefault(num_seqs, collections.deque(maxlen=self.window)).append(seconds)

    def record_verify(self, num_seqs: int, seconds: float, emitted_per_seq: float) -> None:
        self.verify_seconds.setdefault(num_seqs, collections.deque(maxlen=self.window)).append(seconds)
        old = self.emitted_per_seq.get(num_seqs, emitted_per_seq)
        self.emitted_per_seq[num_seqs] = old + self.smoothing * (emitted_per_seq - old)


@dataclasses.dataclass
class SpecStats:
    """Counters since start: how many verify rows drafted each position and how many kept it."""

    num_speculative_tokens: int
    requests_speculating: int = 0  # admissions that speculate
    requests_not_speculating: int = 0  # admissions that do not (the gate, or a hit without the draft's state)
    verifies: int = 0  # sequence-steps that verified at least one draft
    draft_seconds: float = 0.0  # host time proposing
    verify_seconds: float = 0.0  # time of the steps that verified drafts
    drafted: list[int] = dataclasses.field(default_factory=list)  # per draft position
    accepted: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        self.drafted = [0] * self.num_speculative_tokens
        self.accepted = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.verifies += 1
        for j in range(num_drafts):
            self.drafted[j] += 1
            self.accepted[j] += j < num_accepted

    def as_dict(self) -> dict:
        drafted, accepted = sum(self.drafted), sum(self.accepted)
        return {
            "spec_requests_speculating": self.requests_speculating,
            "spec_requests_not_speculating": self.requests_not_speculating,
            "spec_verifies": self.verifies,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_acceptance_rate_per_position": [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted)],
            "spec_mean_accepted_length": 1 + accepted / self.verifies if self.verifies else 0.0,
            "spec_draft_seconds": self.draft_seconds,
            "spec_verify_seconds": self.verify_seconds,
        }
