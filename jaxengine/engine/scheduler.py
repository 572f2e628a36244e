"""The scheduler: which sequences advance by how many tokens in the next step, and the
prefix-cache bookkeeping around each step.

Running sequences go first, decodes before prefill chunks, then waiting sequences are
admitted while the token budget, the sequence cap, blocks and state slots allow. A long
prompt is split over several steps (chunked prefill). When a running sequence needs a page
and none can be had even by evicting cache content, the newest not-yet-scheduled running
sequence is preempted: its blocks and slots are released and it goes back to the front of
the queue, to be recomputed later.

Prefix caching (host side only; the device just follows the index arrays):
  * on admission a sequence takes the longest hit (`PrefixCache.match`): its page table
    starts with the hit's pages and its first step reads the hit's checkpoint (`restores`);
  * full pages are registered under their chained block hash once computed;
  * each step stores the checkpoints `checkpoint_policy.plan` asks for, where the cache has
    room for them at their priority (`saves`); they become readable once the step has run.

Async scheduling (`llm_engine.py`): a step may be scheduled before the tokens of the step
before it are read; a sequence that sampled there counts a token not read yet
(`Sequence.num_unfilled`), which the step takes on the device. Pages and checkpoints whose
prefix hash covers such a token are registered once it is read (`filled`).

Speculation: whether a sequence speculates is decided as it is admitted (`speculates`). One
that does not has no draft state kept for it (the MTP module's KV entries, the draft model's
KV entries and states), so the cached pages and checkpoints it registers are marked as
lacking it, and a sequence whose hit includes such a block does not speculate either.
"""

import collections
import dataclasses
import math
from collections.abc import Callable

from jaxengine.cache import checkpoint_policy
from jaxengine.cache.block_hash import extend_hashes, root_hash
from jaxengine.cache.checkpoint_policy import Kind
from jaxengine.cache.live_slots import LiveSlots
from jaxengine.cache.prefix_cache import PrefixCache
from jaxengine.engine.sequence import Sequence, Status


@dataclasses.dataclass
class CheckpointSave:
    """A checkpoint a step stores: the state of `seqs[seq_index]` after `position` tokens."""

    seq_index: int
    position: int
    blocks: list[int]
    kind: Kind
    hits: int  # the use count it starts with


@dataclasses.dataclass
class ScheduledStep:
    """One step's work: `num_tokens[i]` new tokens of `seqs[i]`; the checkpoints it reads
    (`restores`: sequence index, blocks) and the ones it stores (`saves`). A speculating
    sequence's tokens are its pending token then its `drafts[i]` (so `num_tokens[i]` is
    1 + len(drafts[i])); the others have no drafts."""

    seqs: list[Sequence]
    num_tokens: list[int]
    restores: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
    saves: list[CheckpointSave] = dataclasses.field(default_factory=list)
    drafts: list[list[int]] = dataclasses.field(default_factory=list)

    def drafts_of(self, i: int) -> list[int]:
        return self.drafts[i] if self.drafts else []

    @property
    def is_decode(self) -> bool:
        """Every sequence advances from its live state by its pending token and its drafts
        (none in a plain decode step, some in a verify step): the one-token kernels apply."""
        return not self.restores and all(n == 1 + len(self.drafts_of(i)) for i, n in enumerate(self.num_tokens))

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclasses.dataclass
class CacheStats:
    """Prefix-cache counters since the engine started."""

    tokens_asked: int = 0  # prompt tokens at each admission
    tokens_hit: int = 0  # of those, served from the cache
    tokens_lost: int = 0  # of those, in cached pages past the hit, lost for want of a checkpoint


class Scheduler:
    """Owns the waiting queue, the running list, the prefix cache and the live state slots."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        page_size: int,
        cache: PrefixCache,
        slots: LiveSlots | None,
        retention_interval: int | None = checkpoint_policy.DENSE,
        num_speculative_tokens: int = 0,
        speculates: Callable[[int, bool], bool] | None = None,
    ):
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.cache = cache
        self.slots = slots  # None for models without recurrent layers
        self.retention_interval = retention_interval
        # Speculation: a sequence about to decode verifies the drafts it offers (`SpecState`),
        # and owns a live slot per draft position besides its read and write slots.
        # `speculates(num_seqs, hit_has_draft_state)`: whether a sequence admitted now into a batch
        # of `num_seqs` (those running and waiting, up to max_num_seqs) speculates.
        self.speculates = speculates
        self.without_draft_state: set[int] = set()  # cached blocks a sequence without speculation wrote
        self.slots_per_seq = 2 + num_speculative_tokens
        self.caching = cache.enabled
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.stats = CacheStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_front(self, seqs: list[Sequence]) -> None:
        """Queues `seqs`, in order, ahead of every waiting sequence."""
        self.waiting.extendleft(reversed(seqs))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ resources

    def grow_pages(self, seq: Sequence, num_tokens: int) -> bool:
        """Gives `seq` pages for its first `num_tokens` tokens; False if too few can be had."""
        if not self.cache.has_kv:
            return True
        extra = math.ceil(num_tokens / self.page_size) - len(seq.pages)
        if extra <= 0:
            return True
        got = self.cache.allocate(extra)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def release(self, seq: Sequence) -> None:
        """Returns a sequence's pages and slots; its cached pages and checkpoints stay."""
        if seq.pages:
            self.cache.release(seq.pages)
        if seq.restore is not None:
            self.cache.unpin(seq.restore)
        if seq.owned_slots:
            self.slots.free(seq.owned_slots)
        for save in seq.deferred_saves:
            self.cache.cancel(save.blocks)
        seq.pages, seq.owned_slots, seq.read_slot, seq.restore, seq.deferred_saves = [], [], 0, None, []

    def _preempt(self, seq: Sequence) -> None:
        if seq.status is Status.COMPLETING:  # its output is final: drop the extra step
            self.finish(seq)
            return
        self.running.remove(seq)
        self.release(seq)
        seq.num_computed = seq.num_registered_pages = 0
        seq.junctions = {}
        seq.hit_checkpoint = seq.prompt_checkpoint = seq.trailing_checkpoint = None
        if seq.spec is not None:
            seq.spec.forget_drafts()  # made from the state just let go
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------------ prefix hits

    def _hashes(self, seq: Sequence, drafts: list[int] = ()) -> list[bytes]:
        """Its full pages' hashes (cached on the sequence); with `drafts`, also of the pages
        they would complete if accepted (not cached)."""
        hashes = extend_hashes(seq.block_hashes, seq.tokens, self.page_size, root_hash(seq.cache_salt))
        if drafts:
            hashes = extend_hashes(list(hashes), seq.tokens + drafts, self.page_size, root_hash(seq.cache_salt))
        return hashes

    def _admit(self, seq: Sequence, budget: int, hit: bool = True) -> int:
        """Takes a waiting sequence into the running set; returns its first chunk's size
        (0, and nothing taken, if its slots or pages cannot be had). With nothing running, a
        sequence whose hit leaves too few blocks for the rest (its checkpoint's blocks pinned)
        is taken without the hit (`hit=False`), the cache's content evicted as needed."""
        hashes = self._hashes(seq)[: (seq.num_tokens - 1) // self.page_size]  # leave a token to compute
        if seq.params.prompt_logprobs is not None or not hit:
            hashes = []  # prompt_logprobs: every prompt token's logits are asked for, computed, not hit (as in vLLM)
        match = self.cache.match(hashes)
        slots = None
        if self.slots is not None:
            slots = self.slots.alloc(self.slots_per_seq)
            if slots is None:
                return 0
        self.cache.acquire(match)
        hit = match.hit_pages * self.page_size
        seq.pages = [node.block for node in match.nodes]
        seq.num_computed = hit
        n = min(seq.num_uncomputed, budget)
        if not self.grow_pages(seq, hit + n):
            self.cache.release(seq.pages)
            if match.checkpoint is not None:
                self.cache.unpin(match.checkpoint)
            if slots:
                self.slots.free(slots)
            seq.pages, seq.num_computed = [], 0
            if (match.hit_pages or match.checkpoint is not None) and not self.running:  # nothing else frees blocks
                return self._admit(seq, budget, hit=False)
            return 0
        seq.heat, continues = self.cache.record_hit(match)
        seq.num_registered_pages = match.hit_pages
        seq.junctions = {d * self.page_size: uses for d, uses in match.junctions.items() if d > match.hit_pages}
        # The last page boundary of what it must prefill (its prompt, or all its tokens when
        # recomputed after preemption): the state there is an edge checkpoint.
        seq.prefill_boundary = (seq.num_tokens // self.page_size) * self.page_size
        if slots is not None:
            seq.owned_slots, seq.read_slot = slots, slots[0]
        if self.speculates is not None:  # (`seq` is still among the waiting)
            hit_blocks = seq.pages[: match.hit_pages] + (match.checkpoint.blocks if match.checkpoint else [])
            load = min(self.max_num_seqs, len(self.running) + len(self.waiting))
            seq.spec.speculates = seq.spec.allowed and self.speculates(
                load, self.without_draft_state.isdisjoint(hit_blocks)
            )
        if match.checkpoint is not None:
            seq.restore = match.checkpoint
            if continues:  # superseded once this sequence checkpoints past it
                seq.hit_checkpoint = match.checkpoint.node.block_hash
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit
        self.stats.tokens_asked += seq.num_tokens
        self.stats.tokens_hit += hit
        if self.cache.has_kv:
            self.stats.tokens_lost += (match.reach_pages - match.hit_pages) * self.page_size
        return n

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> ScheduledStep:
        """Picks the next step's sequences and token counts and reserves their blocks."""
        budget = self.max_num_batched_tokens
        step = ScheduledStep([], [])
        # Running sequences: decodes first, then unfinished prefills, oldest first in each.
        pending = sorted(self.running, key=lambda s: s.num_uncomputed > 1)
        while pending and budget > 0:
            seq = pending.pop(0)
            if seq.num_unfilled and seq.stops_for_length:
                continue  # its unread token is its last: nothing to compute for it (see `finish`)
            drafts = self._drafts(seq, budget)
            n = min(seq.num_uncomputed, budget) + len(drafts)
            if drafts and not self.grow_pages(seq, seq.num_computed + n):
                drafts, n = [], 1  # no page for the drafts: decode plainly
            while not self.grow_pages(seq, seq.num_computed + n):
                victim = pending.pop() if pending else seq
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status not in (Status.RUNNING, Status.COMPLETING):
                continue
            step.seqs.append(seq)
            step.num_tokens.append(n)
            step.drafts.append(drafts)
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
            step.drafts.append([])
            budget -= n
        step.restores = [(i, seq.restore.blocks) for i, seq in enumerate(step.seqs) if seq.restore is not None]
        step.saves = self._plan_saves(step)
        return step

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts a running sequence about to decode verifies: those it offers, as many as
        the token budget leaves room for (none for others)."""
        if not seq.speculates or seq.num_uncomputed != 1 or seq.status is not Status.RUNNING or budget < 2:
            return []
        return seq.spec.offered[: budget - 1]

    def _plan_saves(self, step: ScheduledStep) -> list[CheckpointSave]:
        """The checkpoints this step stores, where the cache has room for them: edges and rungs
        first, then candidates, deepest first (a step's candidates may not all fit)."""
        if not self.cache.recurrent or not self.caching:
            return []
        wanted = []
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            if (seq.num_computed + n) // self.page_size == seq.num_computed // self.page_size:
                continue  # its tokens end no page: no checkpoint can lie in them (most decode steps)
            hashes = None
            for pos, kind in checkpoint_policy.plan(
                seq.num_computed,
                seq.num_computed + n,
                page_size=self.page_size,
                interval=self.retention_interval,
                prefill_boundary=seq.prefill_boundary,
                junctions=seq.junctions,
                grain=self.cache.divergences.grain,
            ):
                if hashes is None:  # checkpoints inside drafts are kept only if accepted
                    hashes = self._hashes(seq, step.drafts_of(i))
                k = pos // self.page_size - 1  # the prefix's hash waits for tokens not read yet past the known ones
                block_hash = hashes[k] if k < len(hashes) else None
                if block_hash is None or block_hash not in self.cache.checkpoints:
                    wanted.append((kind is Kind.CANDIDATE, -pos, i, kind, block_hash, hashes))
        saves = []
        for _, neg_pos, i, kind, block_hash, hashes in sorted(wanted, key=lambda w: w[:3]):
            hits = self._hits(step.seqs[i], kind, -neg_pos)
            # A prompt end or a decode boundary ends its path; the sequence goes on past the others.
            ends_path = kind in (Kind.PROMPT, Kind.TRAILING)
            above = self.cache.depth_above(hashes, -neg_pos // self.page_size) if hits else 0
            blocks = self.cache.reserve_checkpoint(
                -neg_pos, kind.origin, hits, block_hash, ends_path=ends_path, above=above
            )
            if blocks is not None:
                saves.append(CheckpointSave(i, -neg_pos, blocks, kind, hits))
        return saves

    def _hits(self, seq: Sequence, kind: Kind, position: int) -> int:
        """The hit count a new checkpoint at `position` starts with (see `checkpoint_policy`):
        a junction's is the number of requests that passed there, this one included; a rung
        starts as used once, a kind of its own; with dense retention a fresh prefix's prompt
        end is a candidate (0) until a request comes back to it."""
        if kind is Kind.CANDIDATE:
            return 0
        if kind is Kind.JUNCTION:
            return seq.junctions[position]
        if kind is Kind.RUNG:
            return 1
        if kind is Kind.PROMPT and seq.heat == 1 and self.retention_interval is checkpoint_policy.DENSE:
            return 0
        return seq.heat

    # ------------------------------------------------------------------ after a step

    def update(self, step: ScheduledStep, kept: list[int] | None = None) -> None:
        """Advances the step's sequences: pages to register, checkpoints to keep, slots to swap.

        `kept[i]`: how many of sequence i's drafts count as computed (the accepted ones, up
        to a stop); the step's states after the others are never read, its KV for them is
        overwritten later, and its checkpoints past them are dropped."""
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            drafts = step.drafts_of(i)
            rejected = len(drafts) - kept[i] if drafts else 0
            n -= rejected
            if seq.owned_slots:
                # The state after its last computed token: the step's final state, or after a
                # rejection the one after that position (its pending token is position 0).
                seq.read_slot = seq.position_slots[kept[i]] if rejected else seq.write_slot
            seq.num_computed += n
            if self.caching:
                self._register_pages(seq)
            if seq.restore is not None:
                self.cache.unpin(seq.restore)
                seq.restore = None
        for save in step.saves:
            seq = step.seqs[save.seq_index]
            if save.position > seq.num_computed:  # after a rejected draft
                self.cache.cancel(save.blocks)
                continue
            self._commit_save(seq, save)
        for seq in step.seqs:
            if seq.status is Status.COMPLETING:
                self.finish(seq)

    def filled(self, seq: Sequence) -> None:
        """Its token sampled by a step before the last was read and appended: the pages and
        checkpoints computed meanwhile whose prefix hash it completes are registered now."""
        if self.caching:
            self._register_pages(seq)
        saves, seq.deferred_saves = seq.deferred_saves, []
        for save in saves:
            self._commit_save(seq, save)

    def _commit_save(self, seq: Sequence, save: CheckpointSave) -> None:
        """Keeps a checkpoint the step wrote, or defers it while its prefix ends past the
        tokens the host has read (`filled`)."""
        hashes = self._hashes(seq)
        k = save.position // self.page_size - 1
        if k >= len(hashes):
            seq.deferred_saves.append(save)
            return
        if self.cache.commit(save.blocks, hashes[k], save.kind.origin, save.hits) is not None:
            self._mark_draft_state(save.blocks, seq.speculates)
            self._note_edge(seq, save, hashes[k])

    def _register_pages(self, seq: Sequence) -> None:
        """Registers its computed full pages, those whose tokens the host has read."""
        if seq.num_computed // self.page_size <= seq.num_registered_pages:
            return  # no page completed since
        hashes = self._hashes(seq)
        end = min(seq.num_computed // self.page_size, len(hashes))
        for i in range(seq.num_registered_pages, end):
            block = seq.pages[i] if self.cache.has_kv else 0
            self.cache.register(block, hashes[i], hashes[i - 1] if i else None, (i + 1) * self.page_size, seq.heat)
            if self.cache.has_kv:
                self._mark_draft_state([block], seq.speculates)
        seq.num_registered_pages = max(seq.num_registered_pages, end)

    def _mark_draft_state(self, blocks: list[int], present: bool) -> None:
        """Notes whether cached `blocks` hold the draft's state (only speculating sequences keep it)."""
        if self.speculates is None:
            return
        if present:
            self.without_draft_state.difference_update(blocks)
        else:
            self.without_draft_state.update(blocks)

    def _note_edge(self, seq: Sequence, save: CheckpointSave, block_hash: bytes) -> None:
        """A sequence's newer edge checkpoint supersedes its older ones on the same path: the
        one it resumed from, its prompt end once it decodes past it, its previous trailing one."""
        if save.kind not in (Kind.PROMPT, Kind.TRAILING):
            return
        if seq.hit_checkpoint is not None:
            self.cache.supersede(seq.hit_checkpoint)
            seq.hit_checkpoint = None
        if save.kind is Kind.PROMPT:
            seq.prompt_checkpoint = block_hash
            return
        if seq.prompt_checkpoint is not None:
            self.cache.decoded_past(seq.prompt_checkpoint)
        if seq.trailing_checkpoint is not None:
            self.cache.supersede(seq.trailing_checkpoint)
        seq.prompt_checkpoint, seq.trailing_checkpoint = None, block_hash

    def abort(self, seq: Sequence) -> None:
        """Drops a request wherever it is; what it holds is released (its cached pages and
        checkpoints stay)."""
        if seq.status is Status.WAITING:
            if seq in self.waiting:  # else not handed to the scheduler yet
                self.waiting.remove(seq)
        elif seq.status in (Status.RUNNING, Status.COMPLETING):
            self.running.remove(seq)
            self.release(seq)
        seq.status = Status.FINISHED
        seq.num_unfilled = 0  # a token of it not read yet is dropped
        if seq.finish_reason is None:
            seq.finish_reason = "abort"

    def cache_report(self, block_bytes: int) -> dict:
        """The prefix cache's hits and the pool's use since start, as `stats()` reports them."""
        cache, slots, c = self.cache, self.slots, self.cache.counters
        asked = self.stats.tokens_asked
        page_blocks = cache.num_page_blocks if cache.has_kv else 0
        return {
            "tokens_asked": asked,
            "tokens_hit": self.stats.tokens_hit,
            "hit_rate": self.stats.tokens_hit / asked if asked else 0.0,
            "tokens_lost_for_want_of_checkpoint": self.stats.tokens_lost,
            "cache_blocks": cache.pool.num_usable,
            "cache_block_bytes": block_bytes,
            "blocks_in_use": cache.pool.num_referenced,
            "kv_pages_cached": page_blocks,
            "kv_page_bytes_held": page_blocks * block_bytes,
            "checkpoints_held": len(cache.checkpoints),
            "checkpoint_bytes_held": cache.num_checkpoint_blocks * block_bytes,
            "kv_page_evictions": c.pages_evicted,
            "checkpoint_evictions": c.checkpoints_evicted,
            "checkpoints_written": c.checkpoints_written,
            "checkpoints_skipped": c.checkpoints_skipped,
            "ssm_live_slots_in_use": len(slots.in_use) if slots else 0,
            "preemptions": self.num_preemptions,
        }

    def recover(self, device_state_lost: bool) -> None:
        """Makes the bookkeeping consistent after a step that failed anywhere: reservations
        are cancelled and every running sequence goes back to the queue, to be recomputed
        (their outputs so far are kept). If the device pools were lost, the cache forgets
        everything they held."""
        self.cache.cancel_all_pending()
        for seq in [*self.running, *self.waiting]:
            seq.deferred_saves = []  # cancelled above
            seq.num_unfilled = 0  # the failed steps' tokens are never read: they are sampled again
        for seq in list(reversed(self.running)):
            if seq.status is Status.COMPLETING:
                self.finish(seq)
            else:
                self._preempt(seq)
        if device_state_lost:
            self.cache.clear()

    def finish(self, seq: Sequence) -> None:
        """Releases a finished sequence's pages and slots (its cached ones stay reusable).

        A sequence whose last sampled token completes a page first takes one more step to
        compute that token (`Status.COMPLETING`; its output is final already): then that page
        is cached and the state after it is a checkpoint, so a next turn hits the whole page
        instead of stopping a page short, for the price of one token. (In an overlapped loop
        that token is often computed already, by the step that ran before its end was read.)"""
        seq.num_unfilled = 0  # a token sampled after its end is dropped
        if seq.status is Status.WAITING:  # preempted before its last token was read
            self.waiting.remove(seq)
            seq.status = Status.FINISHED
            return
        computed = seq.num_computed >= len(seq.tokens)
        if self.caching and len(seq.tokens) % self.page_size == 0 and seq.status is Status.RUNNING and not computed:
            seq.status = Status.COMPLETING
            return
        self.running.remove(seq)
        self.release(seq)
        seq.status = Status.FINISHED

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by tests)."""
        self.cache.check_invariants()
        if self.slots is not None:
            self.slots.check_invariants()
            owned = [s for seq in self.running for s in seq.owned_slots]
            assert len(owned) == len(set(owned)) and set(owned) == self.slots.in_use, "a live slot is lost or shared"
        held = collections.Counter(b for seq in self.running for b in seq.pages)
        assert held == collections.Counter(self.cache.pool.ref_count), "page references are off"
        pins = collections.Counter(seq.restore.node.block_hash for seq in self.running if seq.restore is not None)
        assert pins == collections.Counter({h: c.pins for h, c in self.cache.checkpoints.items() if c.pins}), (
            "checkpoint pins are off"
        )
