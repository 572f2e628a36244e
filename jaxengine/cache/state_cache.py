"""SSM slots: live states of running sequences and snapshot checkpoints of prefixes.

Both kinds live in one device pool (index 0 the null sink) but have separate budgets, so
snapshots can never take a running sequence's slot and running sequences can never
evict a snapshot. A checkpoint is the state (conv + SSM) after exactly `num_tokens` tokens
of a prefix, named by the block hash of that prefix (its length is a page multiple).

Eviction among unpinned snapshots weighs recency against the compute a hit saves per byte
held (after Marconi, MLSys 2025): utility = recency + alpha * flop_efficiency, recency scaled
to [0, 1] over the candidates and saved compute relative to the largest (every snapshot holds
the same bytes); the lowest utility goes first. alpha = 0 is plain LRU.
"""

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass
class Checkpoint:
    """One stored prefix state."""

    slot: int
    block_hash: bytes
    num_tokens: int
    last_access: int
    pins: int = 0
    committed: bool = False  # written by a finished step; before that nobody may read it
    branch: bool = False  # made at a junction, where cached prefixes diverge: never demoted


@dataclasses.dataclass(frozen=True)
class Retention:
    """Which checkpoints the scan scatters: `dense` (every `interval` tokens), `every=N`
    (every N tokens), `sparse` (none; only the edge checkpoints steps end on)."""

    mode: str  # "dense" | "sparse" | "every"
    every: int = 0

    @classmethod
    def parse(cls, text: str, interval: int) -> "Retention":
        if text == "dense":
            return cls("dense", interval)
        if text == "sparse":
            return cls("sparse")
        if text.startswith("every="):
            try:
                n = int(text.split("=", 1)[1])
            except ValueError:
                n = 0
            if n <= 0 or n % interval:
                raise ValueError(f"ssm_retention={text!r}: N must be a positive multiple of ssm_checkpoint_interval={interval}")
            return cls("every", n)
        raise ValueError(f"unknown ssm_retention={text!r}; supported: dense, sparse, every=N")

    def scan_positions(self, start: int, end: int) -> list[int]:
        """Checkpoint positions strictly inside the computed span (start, end)."""
        step = self.every
        if not step:
            return []
        first = (start // step + 1) * step
        return list(range(first, end, step))


class StateCache:
    """Live slots and snapshot checkpoints over one SSM pool of `1 + num_live + num_snapshots`."""

    def __init__(
        self,
        num_live: int,
        num_snapshots: int,
        *,
        flops_saved: Callable[[int], float] = float,
        alpha: float = 1.0,
        enabled: bool = True,
    ):
        if num_live < 2:
            raise ValueError(f"the SSM pool needs at least 2 live slots, got {num_live}")
        self.num_live = num_live
        self.num_snapshots = num_snapshots if enabled else 0
        self.enabled = enabled
        self.flops_saved = flops_saved
        self.alpha = alpha
        self.num_slots = 1 + num_live + self.num_snapshots
        self._free = list(range(self.num_slots - 1, 0, -1))
        self.live: set[int] = set()
        self.snapshots: dict[int, Checkpoint] = {}
        self.slot_of_hash: dict[bytes, int] = {}
        self.clock = 0
        self.evictions = 0

    # ------------------------------------------------------------------ live slots

    @property
    def num_live_free(self) -> int:
        return self.num_live - len(self.live)

    def alloc_live(self, n: int) -> list[int] | None:
        if n > self.num_live_free:
            return None
        slots = [self._free.pop() for _ in range(n)]
        self.live.update(slots)
        return slots

    def free_live(self, slots: list[int]) -> None:
        for slot in slots:
            if slot not in self.live:
                raise RuntimeError(f"SSM slot {slot} freed but not live")
            self.live.remove(slot)
            self._free.append(slot)

    # ------------------------------------------------------------------ snapshots

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def lookup(self, block_hash: bytes) -> Checkpoint | None:
        """The committed checkpoint of that prefix, if any (not taken, not touched)."""
        slot = self.slot_of_hash.get(block_hash) if self.enabled else None
        if slot is None or not self.snapshots[slot].committed:
            return None
        return self.snapshots[slot]

    def pin(self, slot: int) -> None:
        """Keeps a checkpoint from eviction while a step reads it; marks it used now."""
        ckpt = self.snapshots[slot]
        ckpt.pins += 1
        ckpt.last_access = self.tick()

    def unpin(self, slot: int) -> None:
        self.snapshots[slot].pins -= 1

    def _make_room(self) -> bool:
        """Frees one snapshot slot if the budget is full; False if all are pinned."""
        if len(self.snapshots) < self.num_snapshots:
            return True
        candidates = [c for c in self.snapshots.values() if c.pins == 0 and c.committed]
        if not candidates:
            return False
        self.drop(min(candidates, key=self._utility(candidates)).slot)
        self.evictions += 1
        return True

    def _utility(self, candidates: list[Checkpoint]) -> Callable[[Checkpoint], float]:
        times = [c.last_access for c in candidates]
        t_lo, t_span = min(times), (max(times) - min(times)) or 1
        # Saved compute relative to the largest: min-max scaling would blow small differences
        # in prefix length up to the full [0, 1] range and let them outweigh recency.
        g_max = max(self.flops_saved(c.num_tokens) for c in candidates) or 1
        return lambda c: (c.last_access - t_lo) / t_span + self.alpha * self.flops_saved(c.num_tokens) / g_max

    def reserve(self, block_hash: bytes, num_tokens: int) -> int | None:
        """A snapshot slot for a checkpoint a step will write (dense scan checkpoints).
        It becomes readable after `commit`; None when the prefix is already checkpointed,
        or no room can be made."""
        if not self.enabled or block_hash in self.slot_of_hash or not self._make_room():
            return None
        slot = self._free.pop()
        self.snapshots[slot] = Checkpoint(slot, block_hash, num_tokens, self.tick())
        self.slot_of_hash[block_hash] = slot
        return slot

    def demote(self, slot: int) -> None:
        """Makes a checkpoint look least recently used, so it is evicted first (unless it is
        a branch point, which many requests may resume from)."""
        if not self.snapshots[slot].branch:
            self.snapshots[slot].last_access = 0

    def commit(self, slot: int) -> None:
        """The step that writes `slot` has run: the checkpoint may now be read."""
        self.snapshots[slot].committed = True

    def adopt(self, slot: int, block_hash: bytes, num_tokens: int, *, branch: bool = False) -> bool:
        """Turns a live slot that holds the state after `num_tokens` tokens into a committed
        snapshot. False (slot stays live) when that prefix is already checkpointed or the
        snapshot budget is full of pinned checkpoints."""
        if not self.enabled or block_hash in self.slot_of_hash or not self._make_room():
            return False
        self.live.remove(slot)
        self.snapshots[slot] = Checkpoint(slot, block_hash, num_tokens, self.tick(), committed=True, branch=branch)
        self.slot_of_hash[block_hash] = slot
        return True

    def drop(self, slot: int) -> None:
        """Forgets a snapshot and frees its slot (it must not be pinned)."""
        ckpt = self.snapshots.pop(slot)
        if ckpt.pins:
            raise RuntimeError(f"dropping pinned checkpoint in slot {slot}")
        del self.slot_of_hash[ckpt.block_hash]
        self._free.append(slot)

    @property
    def snapshot_tokens(self) -> int:
        return sum(c.num_tokens for c in self.snapshots.values())

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free = set(self._free)
        snaps = set(self.snapshots)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert not (free & self.live) and not (free & snaps) and not (self.live & snaps)
        assert free | self.live | snaps == set(range(1, self.num_slots)), "a slot is lost or slot 0 is in use"
        assert len(self.live) <= self.num_live and len(snaps) <= self.num_snapshots
        assert all(c.pins >= 0 for c in self.snapshots.values())
        assert {c.block_hash: s for s, c in self.snapshots.items()} == self.slot_of_hash
