"""Which checkpoints a step writes, per retention interval."""

import pytest

from jaxengine.cache.checkpoint_policy import DENSE, SPARSE, Kind, plan, validate_interval


def _plan(start, end, interval, prefill_boundary=40, junction=0):
    return plan(start, end, page_size=4, interval=interval, prefill_boundary=prefill_boundary, junctions={junction})


def test_dense_offers_every_page_boundary_the_step_crosses():
    assert _plan(2, 14, DENSE) == [(4, Kind.CANDIDATE), (8, Kind.CANDIDATE), (12, Kind.CANDIDATE)]
    assert _plan(12, 16, DENSE)[-1] == (16, Kind.CANDIDATE)  # its end too


def test_sparse_offers_only_edges():
    got = _plan(0, 48, SPARSE, prefill_boundary=40, junction=20)
    assert got == [(20, Kind.JUNCTION), (40, Kind.PROMPT), (44, Kind.TRAILING), (48, Kind.TRAILING)]


def test_an_interval_offers_its_multiples():
    assert [p for p, k in _plan(0, 40, 16) if k is Kind.CANDIDATE] == [16, 32]


@pytest.mark.parametrize("bad", [-4, 6, 2.0, "8", True])
def test_bad_intervals_are_refused(bad):
    with pytest.raises(ValueError, match="prefix_cache_retention_interval"):
        validate_interval(bad, 4)


def test_good_intervals_pass():
    for good in (None, 0, 4, 64):
        validate_interval(good, 4)


def test_a_grain_puts_edges_and_candidates_on_its_multiples():
    # Grain 3 pages (12 tokens): the prompt edge is the last multiple within the prefill (36 of
    # 40), trailing edges and dense candidates lie on multiples; a junction lies where it lies.
    got = plan(0, 64, page_size=4, interval=DENSE, prefill_boundary=40, junctions={20}, grain=3)
    assert got == [
        (12, Kind.CANDIDATE),
        (20, Kind.JUNCTION),
        (24, Kind.CANDIDATE),
        (36, Kind.PROMPT),
        (48, Kind.TRAILING),
        (60, Kind.TRAILING),
    ]
    # An interval's candidates are the user's choice: the grain leaves them alone.
    assert [
        p for p, k in plan(0, 40, page_size=4, interval=8, prefill_boundary=40, grain=3) if k is Kind.CANDIDATE
    ] == [8, 16, 24, 32]
