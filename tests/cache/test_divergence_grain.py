"""The page multiple prefixes part at, learned from where requests leave known paths."""

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from jaxengine.cache.divergence_grain import MIN_SEEN, QUORUM, WINDOW, DivergenceGrain, divisors


def _grain(depths: list[int]) -> int:
    g = DivergenceGrain()
    for d in depths:
        g.observe(d)
    return g.grain


def test_divisors():
    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(49) == [1, 7, 49]


def test_block_aligned_partings_give_the_block_despite_a_little_noise():
    rng = random.Random(0)
    depths = [32 * rng.randint(1, 40) for _ in range(WINDOW)]
    depths[5] = 32 * 7 + 6  # a partial block reused whole: not a multiple
    assert _grain(depths) == 32
    assert _grain([48 * k for k in range(1, 20)]) == 48  # any size, not only powers of two


def test_partings_anywhere_give_one_page():
    rng = random.Random(1)
    assert _grain([rng.randint(1, 500) for _ in range(WINDOW)]) == 1


def test_too_few_distinct_depths_give_one_page():
    # Every request parting at one depth (a shared system prompt) says nothing of a block size.
    assert _grain([64] * WINDOW) == 1
    assert _grain([32 * k for k in range(1, MIN_SEEN)]) == 1
    assert _grain([32 * k for k in range(1, MIN_SEEN + 1)]) == 32


def test_the_grain_follows_the_recent_window():
    assert _grain([32 * k for k in range(1, 20)] + [3 * k + 1 for k in range(WINDOW)]) == 1


@given(st.lists(st.integers(1, 2000), min_size=1, max_size=2 * WINDOW))
def test_the_grain_is_the_largest_page_multiple_a_quorum_of_recent_depths_share(depths):
    recent = set(depths[-WINDOW:])
    want = 1
    if len(recent) >= MIN_SEEN:  # every g from the largest depth down, spelled out
        need = math.ceil(QUORUM * len(recent))
        want = next(g for g in range(max(recent), 0, -1) if sum(d % g == 0 for d in recent) >= need)
    assert _grain(depths) == want
