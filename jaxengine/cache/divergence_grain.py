"""Where prefixes part, learned online: the page multiple checkpoints are worth writing at.

A hit on a model with recurrent layers can only end where a checkpoint was written, and the
places later requests leave a cached path are where checkpoints pay. With real token ids they
can be any page boundary: a conversation's next turn continues where its last turn stopped.
But traffic whose prefixes are equal only in whole blocks (a system hashing its prompts per
512-token block, as Mooncake's traces do, or templates built from fixed-size parts) parts only
at multiples of the block, and a checkpoint anywhere else can never be hit: the prompt's last
page boundary, the edge the cache keeps for a next turn, lies inside the block the next turn
changes.

So the cache watches the depths at which requests leave cached paths: *divergences* (the
cached path goes on with other tokens) and *extensions* (the cached path ended there, as a
finished sequence left it). Paths whose continuation was evicted say nothing and are not
counted. The grain is the largest number of pages that at least `QUORUM` of the last `WINDOW`
such depths are multiples of (1 until `MIN_SEEN` were seen): edges and dense candidates are
written at its multiples only. A workload that parts anywhere keeps grain 1, today's rule.
"""

import collections
import math

WINDOW = 64  # the depths the grain is learned from
MIN_SEEN = 8  # fewer than this: grain 1
QUORUM = 0.9  # the share of those depths the grain must divide (the rest: noise, e.g. a partial block)


def divisors(n: int) -> list[int]:
    """Every positive divisor of `n` >= 1."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class DivergenceGrain:
    """The depths (in pages) where requests left cached paths, and the grain they share."""

    def __init__(self):
        self.depths: collections.deque[int] = collections.deque(maxlen=WINDOW)
        self._grain: int | None = 1

    def observe(self, depth: int) -> None:
        """A request left a cached path after `depth` >= 1 pages."""
        self.depths.append(depth)
        self._grain = None

    @property
    def grain(self) -> int:
        if self._grain is None:
            self._grain = self._learn()
        return self._grain

    def _learn(self) -> int:
        depths = set(self.depths)
        if len(depths) < MIN_SEEN:
            return 1
        need = math.ceil(QUORUM * len(depths))
        multiples = collections.Counter(g for depth in depths for g in divisors(depth))  # g -> depths it divides
        return max(g for g, count in multiples.items() if count >= need)  # 1 divides them all
