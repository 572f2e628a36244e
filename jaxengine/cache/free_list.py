"""A free list of pool indices (KV pages or SSM slots). Index 0 is the null sink, never handed out."""


class FreeList:
    """Hands out and takes back indices 1..capacity-1 of a device pool."""

    def __init__(self, capacity: int, name: str):
        if capacity < 2:
            raise ValueError(f"{name} pool needs at least 2 entries (index 0 is the null sink), got {capacity}")
        self.name = name
        self.capacity = capacity
        self._free = list(range(capacity - 1, 0, -1))  # pop() hands out low indices first
        self._in_use: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        """Entries that can ever be handed out (all but the sink)."""
        return self.capacity - 1

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    def allocate(self, n: int = 1) -> list[int] | None:
        """`n` free indices, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        taken = [self._free.pop() for _ in range(n)]
        self._in_use.update(taken)
        return taken

    def free(self, indices: list[int]) -> None:
        """Returns indices to the list; freeing one not in use is a bug and raises."""
        for i in indices:
            if i not in self._in_use:
                raise RuntimeError(f"{self.name}: freeing index {i}, which is not in use")
            self._in_use.remove(i)
            self._free.append(i)
