"""The engine loop's one boundary to speculative decoding."""

import time
from collections.abc import Callable

import numpy as np

from jaxengine.engine.batch_builder import Shape
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence import Sequence
from jaxengine.engine.spec.config import SpeculativeConfig
from jaxengine.engine.spec.gate import ProbeBackoff, SpeculationGate
from jaxengine.engine.spec.ngram import NgramIndex
from jaxengine.engine.spec.stats import SpecStats


class Speculator:
    """Decides, around each step, what speculation does in it.

    `before_step` (before scheduling): whether this step drafts (the adaptive gate), ngram's
    lookups, and the drafts each running sequence offers for verification (`SpecState.offered`).
    `drafts_next` (once the step's shape is known): whether the step's MTP module or draft
    model drafts for the next one. `after_step`: the drafts the step made, acceptance counters,
    and the step's time for the gate. `admits` is the scheduler's question as it admits a
    request: does it speculate at all."""

    def __init__(self, config: SpeculativeConfig, *, seq_bucket: Callable[[int], int], max_model_len: int):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.drafts_in_step = config.drafts_in_step  # the MTP module or a draft model
        # Whether this step drafts: always, or with `adaptive` (the default) while it pays.
        self.gate = SpeculationGate() if config.adaptive else None
        self.stats = SpecStats(config.num_speculative_tokens)
        self.drafting = True
        self.drafting_next = False  # this step's drafter drafts for the next step
        self._seq_bucket = seq_bucket
        self._max_model_len = max_model_len
        # The host-side proposer, (sequence, at most) -> drafts: ngram's prompt lookup.
        self.propose: Callable[[Sequence, int], list[int]] = self.ngram_lookup

    def admits(self, num_seqs: int, hit_has_draft_state: bool) -> bool:
        """Whether a sequence admitted into a batch of `num_seqs` speculates: not where its
        prefix hit lacks the draft's state, and, for the methods that draft inside the step
        with the adaptive gate, only where speculation pays against plain decoding (their pass
        over every token is then saved). ngram is decided step by step only."""
        speculates = hit_has_draft_state and (
            self.gate is None or not self.drafts_in_step or self.gate.admits(self._seq_bucket(num_seqs))
        )
        self.stats.requests_speculating += speculates
        self.stats.requests_not_speculating += not speculates
        return speculates

    def before_step(self, running: list[Sequence]) -> None:
        """Decides whether this step drafts (ngram first looks its drafts up where the gate may
        open, so it decides on the share of sequences that have some), then sets what each
        running sequence offers to verify."""
        bucket = self._seq_bucket(max(1, len(running)))
        share = _share_speculating(running)
        if not self.drafts_in_step:
            may_open = self.gate is None or self.gate.may_open_next(bucket, self._lookup_share(running))
            share = self._ngram_proposals(running, may_open) / max(1, len(running))
        if self.gate is not None:
            self.drafting = self.gate.open(bucket, share)
        for seq in running:
            seq.spec.offered = seq.spec.drafts[: self._draft_limit(seq)] if self.drafting else []

    def needs_tokens(self, running: list[Sequence]) -> bool:
        """Whether the next step needs its speculating sequences' last tokens on the host:
        with a drafter, or ngram without the gate, always (the drafter's inputs are built from
        them; ngram looks up at every step); with ngram and the gate where the gate may open
        and a sequence with a token not read yet is due a lookup, so that steps the gate keeps
        plain overlap as a plain engine's do."""
        if self.drafts_in_step or self.gate is None:
            return True
        if not self.gate.may_open_next(self._seq_bucket(max(1, len(running))), self._lookup_share(running)):
            return False
        return any(seq.num_unfilled and self._may_look_up(seq) and self.looks_up(seq, commit=False) for seq in running)

    def _lookup_share(self, running: list[Sequence]) -> float:
        """The most sequences a lookup can give drafts to, as a share of `running`: those whose
        lookup is due (what the gate may open on, before the lookups)."""
        return sum(1 for seq in running if seq.speculates and self.looks_up(seq, commit=False)) / max(1, len(running))

    def _may_look_up(self, seq: Sequence) -> bool:
        """A speculating sequence about to decode with room for drafts."""
        return seq.speculates and seq.num_uncomputed == 1 and self._draft_limit(seq) > 0

    def looks_up(self, seq: Sequence, commit: bool = True) -> bool:
        """Whether ngram looks up a speculating sequence's drafts in the next step the gate may
        open: a lookup needs its last token read first (that step then waits for it), so after
        one that found none, only when its next try is due — counted in the sequence's steps —
        each try that still finds none doubling the wait (as the gate's probes do). Always
        without the gate."""
        return self.gate is None or seq.spec.found or seq.spec.lookups_off.due(commit)

    def overlaps(self, scheduled: ScheduledStep) -> bool:
        """Whether a step's tokens may be read after the next step is dispatched: it verifies
        no drafts, and none of its sequences speculates with a drafter (whose drafts and
        inputs are taken on the host)."""
        if any(scheduled.drafts):
            return False
        return not self.drafts_in_step or not any(seq.speculates for seq in scheduled.seqs)

    def drafts_next(self, seqs: list[Sequence], num_seqs: int, runs_drafter: bool) -> bool:
        """Whether the step's MTP module or draft model (`runs_drafter`) drafts for the next
        step; not in a step the gate runs plain to time it."""
        if not runs_drafter:
            self.drafting_next = False
        elif self.gate is None:
            self.drafting_next = self.drafting
        else:
            self.drafting_next = not self.gate.retiming and self.gate.may_open_next(num_seqs, _share_speculating(seqs))
        return self.drafting_next

    def after_step(
        self,
        scheduled: ScheduledStep,
        *,
        accepted: dict[int, int],
        kept: list[int],
        next_drafts: np.ndarray | None,
        device_seconds: float,
        step_seconds: float | None,
        shape: Shape,
    ) -> None:
        """What the step showed. `accepted`: per sequence (by index) that received tokens, how
        many of its drafts the target agreed with; `kept`: per sequence, the drafts now computed
        (fewer past a stop); `next_drafts` [S, k]: the drafts the step made for the next one
        (None when it made none); `step_seconds`: the whole step's time (None: not to be timed,
        a shape's first step)."""
        for i, n in accepted.items():
            if scheduled.drafts_of(i):
                self.stats.record(len(scheduled.drafts_of(i)), n)
            if self.drafts_in_step:
                scheduled.seqs[i].spec.drafts = next_drafts[i].tolist() if next_drafts is not None else []
        if any(scheduled.drafts):
            self.stats.verify_seconds += device_seconds
        if self.gate is None or not shape.decode or step_seconds is None:
            return  # decode and verify steps are timed whole: the host's work differs too
        if shape.sample_width == 1 and not self.drafting_next:
            self.gate.record_decode(shape.num_seqs, step_seconds, plain=self._plain(scheduled))
        elif any(scheduled.drafts):
            drafting = sum(1 for d in scheduled.drafts if d)
            self.gate.record_verify(shape.num_seqs, step_seconds, 1 + sum(kept) / drafting)

    def _plain(self, scheduled: ScheduledStep) -> bool:
        """Whether a step did none of the method's own work (ngram has none; the MTP module and
        the draft model are not run in a step where no sequence speculates)."""
        return not self.drafts_in_step or not any(seq.speculates for seq in scheduled.seqs)

    def _draft_limit(self, seq: Sequence) -> int:
        """How many drafts a sequence may verify: none past its max_tokens or max_model_len,
        none with bad words (their bans depend on each drafted token)."""
        if seq.bad_word_ids:
            return 0
        return max(
            0,
            min(
                self.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self._max_model_len - len(seq.tokens),
            ),
        )

    def _ngram_proposals(self, running: list[Sequence], may_open: bool) -> int:
        """Sets each running sequence's drafts for this step by prompt lookup where the gate
        `may_open` (only a speculating sequence about to decode, its last token read, whose
        lookup is due has some); how many have some."""
        start = time.perf_counter()
        for seq in running:
            limit = self._draft_limit(seq)
            can = may_open and self._may_look_up(seq) and not seq.num_unfilled
            looks = can and self.looks_up(seq)
            if not can and seq.spec.lookups_off is not None and not seq.spec.found:
                seq.spec.lookups_off.tick()  # a step of its wait in which it could not try
            seq.spec.drafts = self.propose(seq, limit) if looks else []
            if looks and self.gate is not None:  # the lookup's outcome sets when it is next due
                seq.spec.found = bool(seq.spec.drafts)
                if seq.spec.found and seq.spec.lookups_off is not None:
                    seq.spec.lookups_off.reset()
                elif not seq.spec.found and seq.spec.lookups_off is None:
                    seq.spec.lookups_off = ProbeBackoff(self.gate.probe_every, self.gate.max_probe_every)
        self.stats.draft_seconds += time.perf_counter() - start
        return sum(1 for seq in running if seq.spec.drafts)

    def ngram_lookup(self, seq: Sequence, limit: int) -> list[int]:
        """Up to `limit` drafts by prompt lookup over the sequence's own tokens."""
        if seq.spec.ngram is None:
            seq.spec.ngram = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        return seq.spec.ngram.propose(seq.tokens, limit)


def _share_speculating(seqs: list[Sequence]) -> float:
    """The share of `seqs` admitted to speculate."""
    return sum(1 for seq in seqs if seq.speculates) / max(1, len(seqs))
