"""What a hit is worth to the cache, against hand-computed numbers."""

import pytest

from jaxengine.cache.hit_value import ModelCosts

# 10 weights (20 FLOPs per token), attention width 1 (2 * n * n FLOPs over n tokens),
# 4 KV bytes per token, 100 checkpoint bytes.
COSTS = ModelCosts(num_weights=10, attention_width=1, kv_bytes_per_token=4, checkpoint_bytes=100)


def test_prefix_flops_are_linear_plus_attention_quadratic():
    assert COSTS.prefix_flops(10) == 20 * 10 + 2 * 100


def test_a_checkpoint_saves_what_lies_between_it_and_the_one_above():
    # 30 tokens deep, the nearest checkpoint above at 10: (20*30 + 2*900) - (20*10 + 2*100) = 2000
    assert COSTS.checkpoint_value(30, 10, frees_pages=False) == pytest.approx(2000 / 100)
    # ... and when no checkpoint below holds them, the 20 pages' tokens between are freed too
    assert COSTS.checkpoint_value(30, 10, frees_pages=True) == pytest.approx(2000 / (100 + 20 * 4))
    # none above: the whole prefix
    assert COSTS.checkpoint_value(30, 0, frees_pages=True) == pytest.approx(2400 / (100 + 30 * 4))


def test_a_page_past_another_checkpoint_is_worth_a_page_however_deep():
    deep = COSTS.checkpoint_value(1016, 1000, frees_pages=True)
    shallow = COSTS.checkpoint_value(16, 0, frees_pages=True)
    assert shallow < deep < COSTS.checkpoint_value(1000, 0, frees_pages=True)
    assert deep == pytest.approx((20 * 16 + 2 * (1016**2 - 1000**2)) / (100 + 16 * 4))
