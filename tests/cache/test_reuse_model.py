"""The learned eviction ranking: it must follow the workload's reuse distances."""

from jaxengine.cache.reuse_model import JUNCTION, TRAILING, ReuseModel, hit_class

CLS = hit_class(TRAILING, 1)


def test_with_no_data_the_youngest_rank_highest():
    model = ReuseModel(max_ghosts=100)
    assert model.density(CLS, 0) > model.density(CLS, 10) > model.density(CLS, 1000) > 0


def test_a_cyclic_workload_keeps_what_is_closest_to_its_reuse():
    """Hit points reused ~30 requests after they were made, never later: one at age 25 is
    worth more than one at age 2 (LRU would evict it first), one at age 60 almost nothing."""
    model = ReuseModel(max_ghosts=100)
    for _ in range(50):
        model.reused(CLS, 30)
    assert model.density(CLS, 25) > model.density(CLS, 2) > 10 * model.density(CLS, 60)


def test_a_recency_workload_keeps_the_youngest():
    model = ReuseModel(max_ghosts=100)
    for _ in range(50):
        model.reused(CLS, 1)
        model.died(b"x", CLS, 20, now=0)
    assert model.density(CLS, 0) > 5 * model.density(CLS, 10)


def test_a_ghost_hit_turns_a_death_into_a_reuse_at_the_age_it_would_have_had():
    model = ReuseModel(max_ghosts=100)
    for k in range(40):
        model.died(bytes([k]), CLS, age=5, now=100)
    before = model.density(CLS, 20)
    for k in range(40):
        assert model.ghost_hit(bytes([k]), now=125)  # would have been reused at age 30
    assert not model.ghost_hit(bytes([0]), now=126)
    assert model.density(CLS, 20) > 5 * before


def test_more_used_classes_rank_at_least_as_high():
    model = ReuseModel(max_ghosts=100)
    for _ in range(20):
        model.reused(hit_class(TRAILING, 1), 3)
    assert model.density(hit_class(TRAILING, 3), 3) >= model.density(hit_class(TRAILING, 1), 3)


def test_with_no_data_the_more_used_rank_higher():
    model = ReuseModel(max_ghosts=100)
    once, twice, thrice = (model.density(hit_class(JUNCTION, h), 4) for h in (1, 2, 3))
    assert once < twice < thrice
