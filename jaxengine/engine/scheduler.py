"""The scheduler: which sequences advance by how many tokens in the next step, and the
prefix-cache bookkeeping around each step.

Running sequences go first, decodes before prefill chunks, then waiting sequences are
admitted while the token budget, the sequence cap, pages and slots allow. A long prompt is
split over several steps (chunked prefill). When a running sequence needs a page and none
can be had, the newest not-yet-scheduled running sequence is preempted: its pages and slots
are released and it goes back to the front of the queue, to be recomputed later.

Prefix caching (host side only; the device just follows the index arrays):
  * on admission a sequence takes the longest cached prefix whose pages are all cached and,
    if the model has Mamba layers, for which a checkpoint exists at exactly that length: its
    page table starts with those pages and its first step reads that checkpoint;
  * full pages are registered under their chained block hash once computed;
  * whenever a step ends on a page boundary, the slot it wrote holds the exact state there,
    and becomes a checkpoint for free (the sequence takes a fresh slot). Prefill chunks are
    cut to end at the prompt's last page boundary and at junctions (a cached-page boundary
    past the last checkpoint on the path), so the next request with that prefix hits;
  * with `dense` or `every=N` retention, the scan's states at those multiples inside a
    prefill chunk are scattered into snapshot slots reserved here.
"""

import collections
import dataclasses
import math

from jaxengine.cache.block_hash import extend_hashes, root_hash
from jaxengine.cache.page_cache import PageCache
from jaxengine.cache.state_cache import Retention, StateCache
from jaxengine.engine.sequence import Sequence, Status


@dataclasses.dataclass
class ScheduledStep:
    """One step's work: `num_tokens[i]` new tokens of `seqs[i]`, and the scan checkpoints
    `(sequence index, absolute position, snapshot slot)` the step must store."""

    seqs: list[Sequence]
    num_tokens: list[int]
    checkpoints: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """Every sequence advances by exactly one token (the single-token kernels apply)."""
        return all(n == 1 for n in self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclasses.dataclass
class CacheStats:
    """Prefix-cache counters since the engine started."""

    tokens_asked: int = 0  # prompt tokens at each admission
    tokens_hit: int = 0  # of those, served from the cache


class Scheduler:
    """Owns the waiting queue, the running list, and the page and state caches."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        page_size: int,
        pages: PageCache | None,
        states: StateCache | None,
        retention: Retention | None = None,
        enable_prefix_caching: bool = True,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.pages = pages  # None for models without attention layers
        self.states = states  # None for models without Mamba layers
        self.retention = retention or Retention("sparse")
        self.caching = enable_prefix_caching
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.stats = CacheStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ resources

    def grow_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens; False if too few can be had."""
        if self.pages is None:
            return True
        extra = math.ceil(num_tokens / self.page_size) - len(seq.pages)
        if extra <= 0:
            return True
        got = self.pages.allocate(extra)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def release(self, seq: Sequence) -> None:
        """Returns a sequence's pages and slots; its cached pages and checkpoints stay."""
        if self.pages is not None and seq.pages:
            self.pages.release(seq.pages)
        if self.states is not None:
            self._unpin_read(seq)
            if seq.owned_slots:
                self.states.free_live(seq.owned_slots)
        seq.pages, seq.owned_slots, seq.read_slot = [], [], 0

    def _unpin_read(self, seq: Sequence) -> None:
        if seq.read_slot and seq.read_slot not in seq.owned_slots:
            self.states.unpin(seq.read_slot)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = seq.num_registered_pages = 0
        seq.junction = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ prefix hits

    def _hashes(self, seq: Sequence) -> list[bytes]:
        return extend_hashes(seq.block_hashes, seq.tokens, self.page_size, root_hash(seq.cache_salt))

    def _match(self, seq: Sequence) -> tuple[list[int], int, int]:
        """(cached pages to share, hit length, junction) for a sequence about to be admitted."""
        if not self.caching:
            return [], 0, 0
        hashes = self._hashes(seq)[: (len(seq.tokens) - 1) // self.page_size]  # leave a token to compute
        pages = self.pages.lookup(hashes) if self.pages is not None else []
        reach = len(pages) if self.pages is not None else len(hashes)
        if self.states is None:
            return pages, reach * self.page_size, 0
        hit = next((j for j in range(reach, 0, -1) if self.states.lookup(hashes[j - 1])), 0)
        junction = reach * self.page_size if reach > hit else 0
        return pages[:hit], hit * self.page_size, junction

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute next: up to the budget, ending early at a checkpoint target."""
        n = min(seq.num_uncomputed, budget)
        if self.states is not None and self.caching:
            end = seq.num_computed + n
            targets = [t for t in (seq.junction, seq.prefill_boundary) if seq.num_computed < t < end]
            if targets:
                n = min(targets) - seq.num_computed
        return n

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Takes a waiting sequence into the running set; returns its first chunk's size
        (0, and nothing taken, if its slots or pages cannot be had)."""
        shared, hit, junction = self._match(seq)
        slots = []
        if self.states is not None:
            slots = self.states.alloc_live(2)
            if slots is None:
                return 0
        if self.pages is not None:
            self.pages.acquire(shared)
        seq.pages, seq.num_computed, seq.junction = list(shared), hit, junction
        seq.num_registered_pages = len(shared)
        # The last page boundary of what it must prefill (its prompt, or all its tokens when
        # recomputed after preemption): a chunk ends there so that state becomes a checkpoint.
        seq.prefill_boundary = (len(seq.tokens) // self.page_size) * self.page_size
        n = self._chunk(seq, budget)
        if not self.grow_pages(seq, hit + n):
            if self.pages is not None:
                self.pages.release(seq.pages)
            if slots:
                self.states.free_live(slots)
            seq.pages, seq.num_computed, seq.junction = [], 0, 0
            return 0
        if self.states is not None:
            seq.owned_slots = slots
            seq.read_slot = slots[0]
            if hit:
                seq.hit_checkpoint = self._hashes(seq)[hit // self.page_size - 1]
                seq.read_slot = self.states.slot_of_hash[seq.hit_checkpoint]
                self.states.pin(seq.read_slot)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit
        self.stats.tokens_asked += len(seq.tokens)
        self.stats.tokens_hit += hit
        return n

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledStep:
        """Picks the next step's sequences and token counts and reserves their pages."""
        budget = self.max_num_batched_tokens
        step = ScheduledStep([], [])
        # Running sequences: decodes first, then unfinished prefills, oldest first in each.
        pending = sorted(self.running, key=lambda s: s.num_uncomputed > 1)
        while pending and budget > 0:
            seq = pending.pop(0)
            n = self._chunk(seq, budget)
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
        # Admit waiting sequences while everything they need can be had.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            step.seqs.append(seq)
            step.num_tokens.append(n)
            budget -= n
        step.checkpoints = self._reserve_scan_checkpoints(step)
        return step

    def _reserve_scan_checkpoints(self, step: ScheduledStep) -> list[tuple[int, int, int]]:
        if self.states is None or not self.caching or step.is_decode:
            return []
        out = []
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            hashes = self._hashes(seq)
            for pos in self.retention.scan_positions(seq.num_computed, seq.num_computed + n):
                slot = self.states.reserve(hashes[pos // self.page_size - 1], pos)
                if slot is not None:
                    out.append((i, pos, slot))
        return out

    # ------------------------------------------------------------------ after a step

    def update(self, step: ScheduledStep) -> None:
        """Advances the step's sequences: pages to register, slots to rotate, checkpoints to keep."""
        for _, _, slot in step.checkpoints:
            self.states.commit(slot)
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_computed += n
            if self.pages is not None and self.caching:
                hashes = self._hashes(seq)
                for i in range(seq.num_registered_pages, seq.num_computed // self.page_size):
                    self.pages.register(seq.pages[i], hashes[i])
                seq.num_registered_pages = seq.num_computed // self.page_size
            if self.states is not None:
                self._rotate_slots(seq)

    def _rotate_slots(self, seq: Sequence) -> None:
        """The slot just written becomes the one read next; at a page boundary it may become
        a checkpoint, and the sequence then takes a fresh live slot to write into."""
        written, end = seq.write_slot, seq.num_computed
        self._unpin_read(seq)
        seq.read_slot = written
        if not self.caching or end % self.page_size or end == 0:
            return
        kept = end in (seq.junction, seq.prefill_boundary) or (self.retention.every and end % self.retention.every == 0)
        if not kept:
            # A plain page boundary: keep only the latest one of this sequence (so a finished
            # sequence leaves the last boundary it reached, and its next turn hits). The old
            # one goes first, so the new one never evicts another prefix's checkpoint.
            old = self.states.snapshots.get(seq.trailing_checkpoint)
            if old is not None and old.pins == 0 and old.num_tokens < end and old.block_hash in seq.block_hashes:
                self.states.drop(old.slot)
        if seq.hit_checkpoint is not None:
            # The checkpoint this sequence resumed from is now extended by its own: the old
            # one serves only other branches of that prefix, so it is the first to evict
            # (before the new one needs room).
            hit_slot = self.states.slot_of_hash.get(seq.hit_checkpoint)
            if hit_slot is not None and self.states.snapshots[hit_slot].num_tokens < end:
                self.states.demote(hit_slot)
            seq.hit_checkpoint = None
        block_hash = self._hashes(seq)[end // self.page_size - 1]
        if not self.states.adopt(written, block_hash, end, branch=end == seq.junction):
            return
        seq.owned_slots.remove(written)
        seq.owned_slots.extend(self.states.alloc_live(1))
        self.states.pin(written)
        if not kept:
            seq.trailing_checkpoint = written
            if end > seq.prefill_boundary:
                self._demote_prompt_checkpoint(seq)

    def finish(self, seq: Sequence) -> None:
        """Releases a finished sequence's pages and slots (its cached ones stay reusable)."""
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED

    def _demote_prompt_checkpoint(self, seq: Sequence) -> None:
        """Once a sequence has a checkpoint past its prompt's end (the one its next turn will
        hit), the prompt-end checkpoint is only useful to exact repeats: it is made the first
        to evict, so interleaved conversations keep their latest ends."""
        if not seq.prefill_boundary or seq.prefill_boundary == seq.junction:
            return
        slot = self.states.slot_of_hash.get(seq.block_hashes[seq.prefill_boundary // self.page_size - 1])
        if slot is not None:
            self.states.demote(slot)
