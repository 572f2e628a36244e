"""Which checkpoints a step writes, per retention interval."""

import pytest

from jaxengine.cache.checkpoint_policy import DENSE, SPARSE, Kind, plan, validate_interval


def _plan(start, end, interval, prefill_boundary=40, junction=0):
    return plan(start, end, page_size=4, interval=interval, prefill_boundary=prefill_boundary, junctions={junction})


def test_dense_offers_every_page_boundary_the_step_crosses():
    # Pages 1 and 2 are rungs of the prompt's ladder (power-of-two depths), page 3 a candidate.
    assert _plan(2, 14, DENSE) == [(4, Kind.RUNG), (8, Kind.RUNG), (12, Kind.CANDIDATE)]
    assert _plan(12, 16, DENSE)[-1] == (16, Kind.RUNG)  # its end too


def test_dense_rungs_lie_at_power_of_two_depths_before_the_prompt_end():
    got = _plan(0, 160, DENSE, prefill_boundary=150)
    rungs = [p for p, k in got if k is Kind.RUNG]
    assert rungs == [4, 8, 16, 32, 64, 128]  # pages 1, 2, 4, 8, 16, 32
    assert (148, Kind.PROMPT) in got and (160, Kind.TRAILING) in got  # decode boundaries are no rungs
    assert (32, Kind.PROMPT) in _plan(0, 40, DENSE, prefill_boundary=32)  # an edge wins
    assert (16, Kind.JUNCTION) in _plan(0, 40, DENSE, junction=16)
    assert all(k is not Kind.RUNG for _, k in _plan(0, 160, SPARSE, prefill_boundary=150))
    assert all(k is not Kind.RUNG for _, k in _plan(0, 160, 16, prefill_boundary=150))


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
    # 40), trailing edges, dense candidates and rungs lie on multiples; a junction lies where it lies.
    got = plan(0, 64, page_size=4, interval=DENSE, prefill_boundary=40, junctions={20}, grain=3)
    assert got == [
        (12, Kind.RUNG),  # one grain deep
        (20, Kind.JUNCTION),
        (24, Kind.RUNG),  # two
        (36, Kind.PROMPT),
        (48, Kind.TRAILING),
        (60, Kind.TRAILING),
    ]
    # An interval's candidates are the user's choice: the grain leaves them alone.
    assert [
        p for p, k in plan(0, 40, page_size=4, interval=8, prefill_boundary=40, grain=3) if k is Kind.CANDIDATE
    ] == [8, 16, 24, 32]
