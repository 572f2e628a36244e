"""The blocks of the device cache pool: a free list and the running sequences' references.

A block is one KV page of every attention layer (for a model without attention layers, one
block of the checkpoint store). The prefix cache keeps full pages and recurrent-state
checkpoints in blocks; a checkpoint spans several. Block 0 is the null sink, never handed out.
"""


class BlockPool:
    """Free blocks and reference counts of blocks held by running sequences."""

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"the cache pool needs at least 2 blocks (block 0 is the null sink), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))
        self.ref_count: dict[int, int] = {}

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_referenced(self) -> int:
        return len(self.ref_count)

    def take(self, n: int) -> list[int]:
        """`n` free blocks, not referenced (the caller must check `num_free`)."""
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks asked, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            if block in self.ref_count:
                raise RuntimeError(f"block {block} freed while referenced")
            self._free.append(block)

    def reference(self, block: int) -> None:
        self.ref_count[block] = self.ref_count.get(block, 0) + 1

    def unreference(self, block: int) -> bool:
        """Drops one reference; True when it was the last."""
        count = self.ref_count.get(block)
        if count is None:
            raise RuntimeError(f"block {block} released but not referenced")
        if count > 1:
            self.ref_count[block] = count - 1
            return False
        del self.ref_count[block]
        return True

    def free_set(self) -> set[int]:
        """The free blocks (for invariant checks)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        return free
