"""Live recurrent-state slots: the read and write slots of running sequences.

Each running sequence owns two slots of the live state pool; a step reads its state from one
and writes the new state to the other, and the next step swaps them. Checkpoints do not live
here: they are kept in cache blocks (see `prefix_cache.py`). Slot 0 is the null sink.
"""


class LiveSlots:
    """A free list over slots 1..num_slots-1."""

    def __init__(self, num_live: int):
        if num_live < 2:
            raise ValueError(f"the live state pool needs at least 2 slots, got {num_live}")
        self.num_live = num_live
        self._free = list(range(num_live, 0, -1))
        self.in_use: set[int] = set()

    @property
    def num_slots(self) -> int:
        """Rows of the device pool, the null slot included."""
        return self.num_live + 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        slots = [self._free.pop() for _ in range(n)]
        self.in_use.update(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        for slot in slots:
            if slot not in self.in_use:
                raise RuntimeError(f"state slot {slot} freed but not in use")
            self.in_use.remove(slot)
            self._free.append(slot)

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert not free & self.in_use
        assert free | self.in_use == set(range(1, self.num_live + 1)), "a slot is lost or slot 0 is in use"
