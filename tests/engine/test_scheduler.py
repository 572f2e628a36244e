"""The scheduler and the prefix cache's host-side bookkeeping, driven by a fake device.

The fake device does what the real step does to the caches, but with token lists instead
of tensors: it checks that every page a step reads holds exactly the tokens at those
positions and that the SSM slot it reads holds the state of exactly the tokens before the
step, then writes pages, the write slot and the scan checkpoints. Any bookkeeping mistake
(a shared page overwritten, a stale slot read, a checkpoint at the wrong position) fails.
"""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.cache.page_cache import PageCache
from jaxengine.cache.state_cache import Retention, StateCache
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import ScheduledStep, Scheduler
from jaxengine.engine.sequence import Sequence, Status

PAGE = 4
INTERVAL = 8


class FakeDevice:
    """Shadow caches: page -> tokens written there, slot -> the prefix its state covers."""

    def __init__(self):
        self.pages: dict[int, dict[int, int]] = {}
        self.states: dict[int, tuple[int, ...]] = {}

    def run(self, step: ScheduledStep, sched: Scheduler) -> None:
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            start = seq.num_computed
            if sched.pages is not None:
                for pos in range(start):
                    assert self.pages[seq.pages[pos // PAGE]][pos % PAGE] == seq.tokens[pos], "a page read holds other tokens"
            if sched.states is not None:
                if start:
                    assert self.states.get(seq.read_slot) == tuple(seq.tokens[:start]), "stale SSM state read"
                assert seq.write_slot != seq.read_slot and seq.write_slot in seq.owned_slots
            for pos in range(start, start + n):
                if sched.pages is not None:
                    self.pages.setdefault(seq.pages[pos // PAGE], {})[pos % PAGE] = seq.tokens[pos]
            if sched.states is not None:
                self.states[seq.write_slot] = tuple(seq.tokens[: start + n])
            for c_seq, pos, slot in step.checkpoints:
                if c_seq == i:
                    assert start < pos < start + n and pos % INTERVAL == 0
                    self.states[slot] = tuple(seq.tokens[:pos])


def _scheduler(num_pages: int, max_seqs: int, budget: int, *, snapshots: int = 8, retention: str = "sparse",
               attention: bool = True, mamba: bool = True) -> Scheduler:
    return Scheduler(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        page_size=PAGE,
        pages=PageCache(num_pages) if attention else None,
        states=StateCache(2 * max_seqs, snapshots) if mamba else None,
        retention=Retention.parse(retention, INTERVAL),
    )


def _drive(sched: Scheduler, device: FakeDevice, seqs: list[Sequence], outputs: dict[str, list[int]]) -> None:
    """Runs until every sequence is done; the model's 'sampled' tokens come from `outputs`."""
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished:
        step = sched.schedule()
        steps += 1
        assert step.seqs, "a step with pending requests scheduled nothing"
        assert step.total_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        for seq, n in zip(step.seqs, step.num_tokens):
            assert seq.status is Status.RUNNING and 1 <= n <= seq.num_uncomputed
            if sched.pages is not None:
                assert len(seq.pages) * PAGE >= seq.num_computed + n, "tokens scheduled without pages"
        device.run(step, sched)
        sched.update(step)
        for seq in step.seqs:
            if seq.num_computed == len(seq.tokens):
                seq.tokens.append(outputs[seq.request_id][seq.num_output_tokens])
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
        if sched.pages is not None:
            sched.pages.check_invariants()
        if sched.states is not None:
            sched.states.check_invariants()
        assert steps < 20_000


def _assert_all_returned(sched: Scheduler) -> None:
    if sched.pages is not None:
        assert sched.pages.num_in_use == 0 and sched.pages.num_free == sched.pages.num_usable
    if sched.states is not None:
        assert not sched.states.live and all(c.pins == 0 for c in sched.states.snapshots.values())


prefix_st = st.lists(st.integers(0, 3), min_size=0, max_size=40)


@settings(max_examples=60, deadline=None)
@given(
    shared=st.lists(prefix_st, min_size=1, max_size=3),
    requests=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=20), st.integers(1, 8),
                  st.sampled_from([None, "a"])),
        min_size=1, max_size=12,
    ),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 4),
    extra_pages=st.integers(0, 24),
    snapshots=st.integers(0, 6),
    retention=st.sampled_from(["sparse", "dense", "every=16"]),
    kind=st.sampled_from(["hybrid", "attention", "mamba"]),
)
def test_random_workloads_keep_the_caches_consistent(shared, requests, budget, max_seqs, extra_pages, snapshots,
                                                      retention, kind):
    """Requests built from a few shared prefixes (so hits, junctions and shared pages happen)
    under tight pools: every step reads exactly the right tokens and states, the invariants
    hold after every step, every request finishes, and nothing is leaked at the end."""
    prompts = [shared[p % len(shared)] + suffix for p, suffix, _, _ in requests]
    biggest = max(math.ceil((len(p) + m) / PAGE) for p, (_, _, m, _) in zip(prompts, requests))
    sched = _scheduler(1 + biggest + extra_pages, max_seqs, budget, snapshots=snapshots, retention=retention,
                       attention=kind != "mamba", mamba=kind != "attention")
    seqs, outputs = [], {}
    for i, (prompt, (_, _, max_tokens, salt)) in enumerate(zip(prompts, requests)):
        seqs.append(Sequence(str(i), i, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), 0, cache_salt=salt))
        outputs[str(i)] = [(i + k) % 4 for k in range(max_tokens)]
    _drive(sched, FakeDevice(), seqs, outputs)
    assert all(s.status is Status.FINISHED and s.num_output_tokens == s.params.max_tokens for s in seqs)
    _assert_all_returned(sched)
    for s in seqs:
        assert s.num_cached_tokens is not None and s.num_cached_tokens % PAGE == 0 and s.num_cached_tokens < len(s.tokens)


def _one(sched: Scheduler, device: FakeDevice, tokens: list[int], rid: str, max_tokens: int = 1, salt: str | None = None) -> Sequence:
    seq = Sequence(rid, 0, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), 0, cache_salt=salt)
    _drive(sched, device, [seq], {rid: [7] * max_tokens})
    return seq


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_shared_system_prompt_hits_by_the_third_request(budget):
    """A 200-token system prompt then distinct questions: the second request ends a chunk at
    the junction (192), so the third hits there whatever the chunk budget."""
    sched, device = _scheduler(400, 4, budget), FakeDevice()
    system = [i % 97 for i in range(200)]
    hits = [_one(sched, device, system + [100 + r, 101, 102], str(r)).num_cached_tokens for r in range(4)]
    assert hits[0] == 0
    assert hits[2] == hits[3] == 200 // PAGE * PAGE


def test_plain_transformer_hits_at_the_largest_full_page():
    sched, device = _scheduler(400, 4, 64, mamba=False), FakeDevice()
    first = list(range(1000 % 251)) * 5
    first = first[:1000]
    _one(sched, device, first + [1, 2, 3], "a")
    second = _one(sched, device, first + [4, 5], "b")
    assert second.num_cached_tokens == 1000 // PAGE * PAGE


def test_hybrid_hits_at_the_largest_checkpoint_and_the_next_turn_hits_past_the_answer():
    sched, device = _scheduler(600, 4, 64, retention="dense", snapshots=300), FakeDevice()
    first = [i % 53 for i in range(1000)]
    a = _one(sched, device, first + [1, 2, 3], "a", max_tokens=10)
    b = _one(sched, device, first + [4, 5], "b")
    # dense checkpoints every 8 tokens, and the first prompt ended at page boundary 1000
    assert b.num_cached_tokens == 1000
    turn2 = a.tokens + [9, 9, 9]  # prompt + answer + a new message
    c = _one(sched, device, turn2, "c")
    assert c.num_cached_tokens == (len(a.tokens) - 1) // PAGE * PAGE  # the last boundary turn 1 reached


def test_different_salts_share_nothing():
    sched, device = _scheduler(400, 4, 64), FakeDevice()
    prompt = list(range(50))
    _one(sched, device, prompt, "a", salt="x")
    _one(sched, device, prompt, "b", salt="x")
    assert _one(sched, device, prompt, "c", salt="x").num_cached_tokens > 0
    assert _one(sched, device, prompt, "d", salt="y").num_cached_tokens == 0
    assert _one(sched, device, prompt, "e").num_cached_tokens == 0


def test_small_pool_preempts_newest_and_recomputes():
    """Two sequences that cannot both hold their pages: the newer one is preempted and finishes later."""
    sched, device = _scheduler(1 + 6, 2, 64), FakeDevice()
    old = Sequence("old", 0, list(range(10)), 10, SamplingParams(max_tokens=10), 0)
    new = Sequence("new", 1, list(range(20, 30)), 10, SamplingParams(max_tokens=10), 0)
    _drive(sched, device, [old, new], {"old": [1] * 10, "new": [2] * 10})
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    _assert_all_returned(sched)


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = _scheduler(100, 4, 16, mamba=False)
    short = Sequence("a", 0, [1, 2], 2, SamplingParams(max_tokens=5), 0)
    sched.add(short)
    step = sched.schedule()
    sched.update(step)
    short.tokens.append(3)  # now decoding
    sched.add(Sequence("b", 1, list(range(40)), 40, SamplingParams(max_tokens=5), 0))
    step = sched.schedule()
    assert step.seqs[0] is short and step.num_tokens[0] == 1
    assert step.num_tokens[1] == 15  # the rest of the budget goes to the prompt's first chunk


def test_page_cache_rejects_double_release_and_never_hands_out_the_sink():
    pc = PageCache(4)
    got = pc.allocate(3)
    assert sorted(got) == [1, 2, 3]
    assert pc.allocate(1) is None
    pc.release([2])
    with pytest.raises(RuntimeError, match="not referenced"):
        pc.release([2])
    with pytest.raises(ValueError, match="at least 2"):
        PageCache(1)


def test_unreferenced_cached_pages_are_evicted_least_recently_used_first():
    pc = PageCache(4)
    a, b, c = pc.allocate(3)
    for page, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pc.register(page, h)
    pc.release([b])
    pc.release([a])
    pc.release([c])  # LRU order: b, a, c
    assert pc.allocate(1) == [b] and pc.lookup([b"b"]) == []
    assert pc.lookup([b"a"]) == [a]
    pc.check_invariants()
