"""When cached hit points get reused, learned online: the prefix cache's eviction ranking.

A hit point (a checkpoint, or a leaf page of an attention-only model) is worth keeping if it
will be hit again soon and a hit saves much. The model estimates the first part from what the
workload did so far, per *class* of hit point, as a function of its *age* (requests admitted
since it was made or last used). A class is where the hit point came from (a page, a prompt
end, a junction, a decode boundary, a checkpoint requests went past, or a rung of a
prompt's ladder, `checkpoint_policy`) and how often it has been used (1, 2, 3 or more).
Speculative checkpoints (used 0 times, class 0) are not modelled: the cache keeps them in a
tier below all used content.

    rank = P(reused | class, age) / E[requests until that reuse | class, age] * value

`value` is the compute a hit there saves per byte its eviction frees (`hit_value.py`; for a
checkpoint, over the nearest checkpoint above it: `prefix_cache`). This follows the hit
density of LHD (Beckmann, Chen & Cidon, NSDI 2018) with compute savings as the gain. It needs
no constant from the user: a conversation trace whose turns come back ~30 requests apart
teaches it that fresh chains are reused at age ~30 and never after, so it keeps the chains
that are closest to their next turn and drops those past it (where LRU would evict exactly
the chain needed next), while a workload that reuses what it just made teaches it to keep
the youngest (LRU's choice).

Reuses are counted at their age, evictions as deaths at theirs; an evicted hit point is
remembered as a *ghost* for a while, and a request that would have hit it turns its death
into a reuse at the age it would have had, so the model learns reuse distances beyond what
the cache can hold. Counts halve as new events arrive, so the model follows a changing
workload. Each class starts from one pseudo-reuse and 1/uses pseudo-deaths spread over all
ages (LRU until data says otherwise, and a prefix used more often likelier to be used again),
and ranks at least as high as a less used class of the same origin at the same age. Ties go
by use count, then least recently pushed.

The prior's reuse ages (up to 2**20 requests, about 100,000 on average) stay in the expected
wait for as long as the counts do. Against the waits workloads show (tens to hundreds of
requests), E[wait] is then about 100,000 requests over the class's reuses at or past the
age, so the rank weighs how many reuses a class has seen there, not only how soon each of
its hit points comes back: a class of many members (the contexts of many users) outranks a
class of few that come back sooner (the system prompts those users share). A prior of a
hundredth or a tenth of that weight, and LHD's own estimate (reuses over the expected
remaining lifetime, deaths' ages included), rank by the measured waits; each kept those
system prompts but lost more hits than it gained over the replay's traces (BENCHMARKS.md,
"The reuse model's prior"), so the prior keeps its full weight.
"""

import collections
import math

import numpy as np

# Where a hit point came from; PASSED: a checkpoint requests went past, a prompt end its
# sequence has since decoded past or a candidate a running request resumed from on a cached path;
# RUNG: a checkpoint of a prompt's ladder (`checkpoint_policy`), not hit yet.
PAGE, PROMPT, JUNCTION, TRAILING, PASSED, RUNG = range(6)
NUM_ORIGINS = RUNG + 1
HIT_LEVELS = 3  # used once, twice, three times or more
NUM_CLASSES = 1 + NUM_ORIGINS * HIT_LEVELS
BINS_PER_OCTAVE = 4
NUM_BINS = 1 + BINS_PER_OCTAVE * 32


def age_bin(age: int) -> int:
    """Ages on a log scale: bin 0 is age 0, then four bins per doubling."""
    if age <= 0:
        return 0
    return min(NUM_BINS - 1, 1 + int(BINS_PER_OCTAVE * math.log2(age)))


def hit_class(origin: int, hits: int) -> int:
    """The class of a hit point of `origin` used `hits` times (0: speculative)."""
    if hits <= 0:
        return 0
    return 1 + origin * HIT_LEVELS + min(hits, HIT_LEVELS) - 1


def _less_used(cls: int) -> list[int]:
    """The classes of the same origin used as often or less."""
    if cls == 0:
        return [0]
    origin, level = divmod(cls - 1, HIT_LEVELS)
    return [1 + origin * HIT_LEVELS + lv for lv in range(level + 1)]


REUSES, REUSE_AGES, DEATHS = range(3)  # the counts per class and age bin (`ReuseModel.counts`)


def _prior(uses: int) -> np.ndarray:
    """[3, NUM_BINS]: for a class used `uses` times, one pseudo-reuse and 1 / `uses`
    pseudo-deaths, each spread evenly over ages 1, 2, 4, ... 2**20 (no scale preferred). The
    expected wait grows with age, so until data says otherwise the youngest go last (LRU), and
    the more used a hit point the likelier its reuse (`uses` / (`uses` + 1)), so a prefix two
    requests shared outranks one request's own."""
    counts = np.zeros((3, NUM_BINS))
    ages = [2**k for k in range(21)]
    for age in ages:
        counts[REUSES, age_bin(age)] += 1 / len(ages)
        counts[REUSE_AGES, age_bin(age)] += age / len(ages)
        counts[DEATHS, age_bin(age)] += 1 / uses / len(ages)
    return counts


class ReuseModel:
    """Reuse and death counts per class and age bin, with ghost memory of evictions."""

    def __init__(self, max_ghosts: int):
        # [NUM_CLASSES, 3, NUM_BINS]: reuses, the sum of their ages, and deaths per age bin.
        self.counts = np.stack(
            [np.zeros((3, NUM_BINS))] + [_prior(1 + (c - 1) % HIT_LEVELS) for c in range(1, NUM_CLASSES)]
        )
        self._less_used = [_less_used(c) for c in range(NUM_CLASSES)]
        self.max_ghosts = max_ghosts
        # block hash -> (class, age at eviction, request clock at eviction)
        self.ghosts: collections.OrderedDict[bytes, tuple[int, int, int]] = collections.OrderedDict()
        self._events = 0.0
        self._tables: list[list[list[float]]] | None = None

    # ------------------------------------------------------------------ events

    def reused(self, cls: int, age: int) -> None:
        if cls == 0:
            return
        self.counts[cls, REUSES, age_bin(age)] += 1
        self.counts[cls, REUSE_AGES, age_bin(age)] += age
        self._event()

    def died(self, block_hash: bytes, cls: int, age: int, now: int) -> None:
        """A used hit point was evicted (speculative ones are not modelled)."""
        if cls == 0:
            return
        self.counts[cls, DEATHS, age_bin(age)] += 1
        self.ghosts[block_hash] = (cls, age, now)
        self.ghosts.move_to_end(block_hash)
        while len(self.ghosts) > self.max_ghosts:
            self.ghosts.popitem(last=False)
        self._event()

    def ghost_hit(self, block_hash: bytes, now: int) -> bool:
        """A request wanted an evicted hit point: its death becomes a reuse at the age it
        would have had. True if `block_hash` was a ghost."""
        ghost = self.ghosts.pop(block_hash, None)
        if ghost is None:
            return False
        cls, age, evicted_at = ghost
        b = age_bin(age)
        self.counts[cls, DEATHS, b] = max(0.0, self.counts[cls, DEATHS, b] - 1)
        self.reused(cls, age + now - evicted_at)
        return True

    def _event(self) -> None:
        self._tables = None
        self._events += 1
        # Halve the counts every so many events, so old behaviour fades.
        if self._events >= max(256.0, 2.0 * self.max_ghosts):
            self.counts *= 0.5
            self._events = 0.0

    # ------------------------------------------------------------------ ranking

    def _suffix_tables(self) -> list[list[list[float]]]:
        """Per class, suffix sums over bins >= b of reuses, reuse ages and deaths ([3][NUM_BINS]
        lists). Recomputed after each event, which evictions under memory pressure make every
        step: one cumulative sum over all classes, added from the oldest bin down."""
        if self._tables is None:
            self._tables = np.cumsum(self.counts[:, :, ::-1], axis=2)[:, :, ::-1].tolist()
        return self._tables

    def density(self, cls: int, age: int) -> float:
        """Expected reuses per request of waiting for a used hit point of `cls` at `age`; at
        least that of a less used class of the same origin at the same age."""
        return max(self._class_density(c, age) for c in self._less_used[cls])

    def _class_density(self, cls: int, age: int) -> float:
        r, a, d = self._suffix_tables()[cls]
        b = age_bin(age)
        reuses = r[b]
        if reuses <= 0:
            return 0.0
        probability = reuses / (reuses + d[b])
        wait = max(1.0, a[b] / reuses - age)
        return probability / wait
