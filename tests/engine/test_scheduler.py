"""The scheduler and free lists on their own, driven by a fake model that only counts tokens."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.cache.free_list import FreeList
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import Scheduler
from jaxengine.engine.sequence import Sequence, Status

PAGE = 4


def _run_to_completion(sched: Scheduler, seqs: list[Sequence], budget: int, max_seqs: int) -> int:
    """Steps until every sequence is done, checking invariants after each step; returns steps."""
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished:
        step = sched.schedule()
        steps += 1
        assert step.seqs, "a step with pending requests scheduled nothing"
        assert sum(step.num_tokens) <= budget
        assert len(sched.running) <= max_seqs
        assert len({id(s) for s in step.seqs}) == len(step.seqs)
        owned = [p for s in sched.running for p in s.pages]
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert 0 not in owned, "the null page was handed out"
        assert len(owned) == sched.pages.num_in_use
        for seq, n in zip(step.seqs, step.num_tokens):
            assert seq.status is Status.RUNNING
            assert 1 <= n <= seq.num_uncomputed
            assert len(seq.pages) * PAGE >= seq.num_computed + n, "tokens scheduled without pages"
            assert len(seq.slots) == 2
        for seq, n in zip(step.seqs, step.num_tokens):
            seq.num_computed += n
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
        assert steps < 10_000
    return steps


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=20),
    budget=st.integers(8, 64),
    max_seqs=st.integers(1, 6),
    extra_pages=st.integers(0, 30),
)
def test_every_request_finishes_and_everything_is_freed(lengths, budget, max_seqs, extra_pages):
    """Random workloads under a tight pool: no page owned twice, budget and cap respected,
    every request finishes with its max_tokens, and all pages and slots come back."""
    biggest = max(math.ceil((p + m) / PAGE) for p, m in lengths)
    pages = FreeList(1 + biggest + extra_pages, "page")
    slots = FreeList(1 + 2 * max_seqs, "slot")
    sched = Scheduler(max_num_seqs=max_seqs, max_num_batched_tokens=budget, page_size=PAGE, pages=pages, slots=slots)
    seqs = [
        Sequence(str(i), i, list(range(p)), p, SamplingParams(max_tokens=m), 0) for i, (p, m) in enumerate(lengths)
    ]
    _run_to_completion(sched, seqs, budget, max_seqs)
    assert all(s.status is Status.FINISHED and s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert pages.num_free == pages.num_usable and pages.num_in_use == 0
    assert slots.num_free == slots.num_usable and slots.num_in_use == 0


def test_small_pool_preempts_newest_and_recomputes():
    """Two sequences that cannot both hold their pages: the newer one is preempted,
    loses its pages and progress, and still finishes later."""
    pages = FreeList(1 + 6, "page")  # 6 usable pages of 4 tokens
    slots = FreeList(5, "slot")
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=64, page_size=PAGE, pages=pages, slots=slots)
    old = Sequence("old", 0, list(range(10)), 10, SamplingParams(max_tokens=10), 0)
    new = Sequence("new", 1, list(range(10)), 10, SamplingParams(max_tokens=10), 0)
    _run_to_completion(sched, [old, new], 64, 2)
    assert new.num_preemptions >= 1
    assert old.num_preemptions == 0
    assert sched.num_preemptions == new.num_preemptions
    assert pages.num_in_use == 0


def test_decodes_are_scheduled_before_prefill_chunks():
    """A running decode gets its token even when a long prompt could use the whole budget."""
    pages = FreeList(100, "page")
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=16, page_size=PAGE, pages=pages, slots=None)
    short = Sequence("a", 0, [1, 2], 2, SamplingParams(max_tokens=5), 0)
    sched.add(short)
    step = sched.schedule()
    short.num_computed += step.num_tokens[0]
    short.tokens.append(3)  # now decoding
    sched.add(Sequence("b", 1, list(range(40)), 40, SamplingParams(max_tokens=5), 0))
    step = sched.schedule()
    assert step.seqs[0] is short and step.num_tokens[0] == 1
    assert step.num_tokens[1] == 15  # the rest of the budget goes to the prompt's first chunk


def test_free_list_rejects_double_free_and_never_hands_out_the_sink():
    fl = FreeList(4, "page")
    got = fl.allocate(3)
    assert sorted(got) == [1, 2, 3]
    assert fl.allocate(1) is None
    fl.free([2])
    with pytest.raises(RuntimeError, match="not in use"):
        fl.free([2])
    with pytest.raises(ValueError, match="at least 2"):
        FreeList(1, "page")
