"""Whether drafting pays: the adaptive gate (`"adaptive": true`, the default)."""

import collections
import dataclasses
import statistics


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

    def tick(self) -> None:
        """Counts a call that could not try: the next one that can is due once the wait is up."""
        self.count = min(self.count + 1, self.wait - 1)

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
    """Decides whether drafting pays at the current batch size: step by step (`open`), and
    for the methods that draft inside the step also per request as it is admitted (`admits`).

    Per sequence bucket S it keeps the median of the last `window` whole-step times (host work
    included) of decode steps that do the method's work, plain decode steps, and verify steps,
    and an average of the tokens a verify step emits per drafting sequence. A verify step costs
    the same however many of its sequences draft, so with a share f drafting it pays when
    1 + f * (emitted - 1) >= t_verify / t_decode. Until both times are known it measures them.
    While speculation pays, every `probe_every`-th step is a decode step (re-timing it); while
    it does not, a probe verifies after `probe_every` steps off, each probe that finds it still
    not paying doubling the wait up to `max_probe_every` (`ProbeBackoff`). A request admitted
    into S sequences speculates where verify steps beat plain ones by `admit_margin` (what step
    times leave out: the method's pass over the prompt, the probes); otherwise every
    (`probe_every` x S)-th admission still does, with the same doubling."""

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
