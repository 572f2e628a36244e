"""The page multiple prefixes part at, learned from where requests leave known paths."""

import random

from jaxengine.cache.divergence_grain import MIN_SEEN, WINDOW, DivergenceGrain, divisors


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
