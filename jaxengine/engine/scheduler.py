"""The scheduler: which sequences advance by how many tokens in the next step.

Running sequences go first, decodes before prefill chunks, then waiting sequences are
admitted while the token budget, the sequence cap, pages and slots allow. A long prompt
is split over several steps (chunked prefill). When a running sequence needs a page and
none is free, the newest not-yet-scheduled running sequence is preempted: its pages and
slots are freed and it goes back to the front of the queue, to be recomputed later.
"""

import collections
import dataclasses
import math

from jaxengine.cache.free_list import FreeList
from jaxengine.engine.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledStep:
    """One step's work: `num_tokens[i]` new tokens of `seqs[i]`."""

    seqs: list[Sequence]
    num_tokens: list[int]

    @property
    def is_decode(self) -> bool:
        """Every sequence advances by exactly one token (the single-token kernels apply)."""
        return all(n == 1 for n in self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Owns the waiting queue, the running list and the page and slot free lists."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        page_size: int,
        pages: FreeList | None,
        slots: FreeList | None,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.pages = pages  # None for models without attention layers
        self.slots = slots  # None for models without Mamba layers
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def grow_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens; False if too few are free."""
        if self.pages is None:
            return True
        extra = self._pages_for(num_tokens) - len(seq.pages)
        if extra <= 0:
            return True
        got = self.pages.allocate(extra)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def release(self, seq: Sequence) -> None:
        if self.pages is not None and seq.pages:
            self.pages.free(seq.pages)
        if self.slots is not None and seq.slots:
            self.slots.free(seq.slots)
        seq.pages, seq.slots = [], []

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledStep:
        """Picks the next step's sequences and token counts and reserves their pages."""
        budget = self.max_num_batched_tokens
        step = ScheduledStep([], [])
        # Running sequences: decodes first, then unfinished prefills, oldest first in each.
        pending = sorted(self.running, key=lambda s: s.num_uncomputed > 1)
        while pending and budget > 0:
            seq = pending.pop(0)
            n = min(seq.num_uncomputed, budget)
            while not self.grow_pages(seq, seq.num_computed + n):
                victim = pending.pop() if pending else seq
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            step.seqs.append(seq)
            step.num_tokens.append(n)
            budget -= n
        # Admit waiting sequences while everything they need is free.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            slots = self.slots.allocate(2) if self.slots is not None else []
            if slots is None:
                break
            if not self.grow_pages(seq, seq.num_computed + n):
                if slots:
                    self.slots.free(slots)
                break
            self.waiting.popleft()
            seq.slots = slots
            seq.status = Status.RUNNING
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_tokens.append(n)
            budget -= n
        return step

    def finish(self, seq: Sequence) -> None:
        """Frees a finished sequence's pages and slots."""
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED
