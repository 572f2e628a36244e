"""The scheduler and the prefix cache's host-side bookkeeping, driven by a fake device.

The fake device does what the real step does to the pools, with token lists instead of
tensors: a cache block holds either a page's tokens or a piece of a checkpoint (the prefix
its state covers), a live slot the prefix its state covers. Every read is checked: each page
a step reads holds exactly the tokens at those positions, the state a step starts from
(its read slot, or the checkpoint blocks of its hit) covers exactly the tokens before the
step, and a step never writes a block another sequence or the cache holds. Any bookkeeping
mistake (a shared page overwritten, a checkpoint whose blocks were reused, a stale slot, a
checkpoint at the wrong position) fails.
"""

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from jaxengine.cache import checkpoint_policy
from jaxengine.cache.block_pool import BlockPool
from jaxengine.cache.hit_value import ModelCosts
from jaxengine.cache.live_slots import LiveSlots
from jaxengine.cache.prefix_cache import PrefixCache
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import ScheduledStep, Scheduler
from jaxengine.engine.sequence import Sequence, Status
from tests.property_examples import examples

PAGE = 4
CKPT_BLOCKS = 3  # a checkpoint spans three blocks
COSTS = ModelCosts(num_weights=1000, attention_width=8, kv_bytes_per_token=16, checkpoint_bytes=CKPT_BLOCKS * 64)


class FakeDevice:
    """Shadow pools: block -> ("page", {offset: token}) or ("ckpt", prefix, piece); slot -> prefix."""

    def __init__(self):
        self.blocks: dict[int, tuple] = {}
        self.slots: dict[int, tuple[int, ...]] = {}

    def run(self, step: ScheduledStep, sched: Scheduler) -> None:
        cache = sched.cache
        restores = dict(step.restores)
        saved_blocks = [b for s in step.saves for b in s.blocks]
        assert len(saved_blocks) == len(set(saved_blocks)), "two checkpoints of a step share a block"
        for i, (seq, n) in enumerate(zip(step.seqs, step.num_tokens)):
            start = seq.num_computed
            if cache.has_kv:
                for pos in range(start):
                    kind, tokens = self.blocks.get(seq.pages[pos // PAGE], (None, None))[:2]
                    assert kind == "page" and tokens.get(pos % PAGE) == seq.tokens[pos], (
                        "a page read holds other tokens"
                    )
            if cache.recurrent:
                assert seq.write_slot != seq.read_slot and seq.write_slot in seq.owned_slots
                if i in restores:
                    prefix = tuple(seq.tokens[:start])
                    for piece, block in enumerate(restores[i]):
                        assert self.blocks.get(block) == ("ckpt", prefix, piece), "a checkpoint read was overwritten"
                elif start:
                    assert self.slots.get(seq.read_slot) == tuple(seq.tokens[:start]), "stale state read"
            for pos in range(start, start + n):
                if cache.has_kv:
                    block = seq.pages[pos // PAGE]
                    assert cache.pool.ref_count.get(block) == 1, "a step writes a page it does not own alone"
                    assert block not in saved_blocks and block not in cache.pending, "a page write hits a checkpoint"
                    if self.blocks.get(block, ("",))[0] != "page" or pos % PAGE == 0:
                        self.blocks[block] = ("page", {})
                    self.blocks[block][1][pos % PAGE] = seq.tokens[pos]
            if cache.recurrent:
                self.slots[seq.write_slot] = tuple(seq.tokens[: start + n])
        for save in step.saves:
            seq = step.seqs[save.seq_index]
            start, n = seq.num_computed, step.num_tokens[save.seq_index]
            assert start < save.position <= start + n and save.position % PAGE == 0
            for piece, block in enumerate(save.blocks):
                assert block not in cache.pool.ref_count, "a checkpoint write hits a running sequence's page"
                self.blocks[block] = ("ckpt", tuple(seq.tokens[: save.position]), piece)


def _scheduler(
    num_blocks: int,
    max_seqs: int,
    budget: int,
    *,
    retention: int | None = checkpoint_policy.DENSE,
    attention: bool = True,
    mamba: bool = True,
    caching: bool = True,
) -> Scheduler:
    cache = PrefixCache(
        BlockPool(num_blocks),
        page_size=PAGE,
        has_kv=attention,
        checkpoint_blocks=CKPT_BLOCKS if mamba else 0,
        value=COSTS.value_fn(),
        checkpoint_value=COSTS.checkpoint_value,
        enabled=caching,
    )
    return Scheduler(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        page_size=PAGE,
        cache=cache,
        slots=LiveSlots(2 * max_seqs) if mamba else None,
        retention_interval=retention,
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
        assert len(step.saves) <= checkpoint_policy.max_per_step(step.total_tokens, len(step.seqs), PAGE)
        for seq, n in zip(step.seqs, step.num_tokens):
            assert seq.status in (Status.RUNNING, Status.COMPLETING) and 1 <= n <= seq.num_uncomputed
            if seq.status is Status.COMPLETING:  # its last token, which completes a page
                assert n == 1 and len(seq.tokens) % PAGE == 0
            if sched.cache.has_kv:
                assert len(seq.pages) * PAGE >= seq.num_computed + n, "tokens scheduled without pages"
        device.run(step, sched)
        sched.update(step)
        for seq in step.seqs:
            if seq.status is Status.RUNNING and seq.num_computed == len(seq.tokens):
                seq.tokens.append(outputs[seq.request_id][seq.num_output_tokens])
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
        sched.check_invariants()
        assert steps < 20_000


def _assert_all_returned(sched: Scheduler) -> None:
    assert sched.cache.pool.num_referenced == 0 and not sched.cache.pending
    assert all(c.pins == 0 for c in sched.cache.checkpoints.values())
    if sched.slots is not None:
        assert not sched.slots.in_use


prefix_st = st.lists(st.integers(0, 3), min_size=0, max_size=40)
workload_st = dict(
    shared=st.lists(prefix_st, min_size=1, max_size=3),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.lists(st.integers(0, 3), min_size=1, max_size=20),
            st.integers(1, 8),
            st.sampled_from([None, "a"]),
        ),
        min_size=1,
        max_size=12,
    ),
    budget=st.integers(4, 40),
    max_seqs=st.integers(1, 4),
    extra_blocks=st.integers(0, 40),
    retention=st.sampled_from([checkpoint_policy.DENSE, checkpoint_policy.SPARSE, 8]),
    kind=st.sampled_from(["hybrid", "attention", "mamba"]),
)


def _run_workload(
    shared, requests, budget, max_seqs, extra_blocks, retention, kind
) -> tuple[Scheduler, list[Sequence]]:
    prompts = [shared[p % len(shared)] + suffix for p, suffix, _, _ in requests]
    biggest = max(math.ceil((len(p) + m) / PAGE) for p, (_, _, m, _) in zip(prompts, requests))
    # Room for the largest request's pages (or, without attention layers, one checkpoint) plus a few spare.
    sched = _scheduler(
        2 + (biggest if kind != "mamba" else 0) + extra_blocks,
        max_seqs,
        budget,
        retention=retention,
        attention=kind != "mamba",
        mamba=kind != "attention",
    )
    seqs, outputs = [], {}
    for i, (prompt, (_, _, max_tokens, salt)) in enumerate(zip(prompts, requests)):
        seqs.append(
            Sequence(str(i), i, list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), 0, cache_salt=salt)
        )
        outputs[str(i)] = [(i + k) % 4 for k in range(max_tokens)]
    _drive(sched, FakeDevice(), seqs, outputs)
    return sched, seqs


@settings(max_examples=examples(80), deadline=None)
@given(**workload_st)
# Found by the search: a hit whose checkpoint pins the blocks the rest of the prompt needs,
# with nothing running that could free others (the sequence must be taken as a miss).
@example(
    shared=[[]],
    requests=[(0, [0], 1, None), (0, [0] * 4, 1, None), (0, [0] * 8, 1, None)],
    budget=4,
    max_seqs=1,
    extra_blocks=0,
    retention=None,
    kind="hybrid",
)
def test_random_workloads_keep_the_caches_consistent(shared, requests, budget, max_seqs, extra_blocks, retention, kind):
    """Requests built from a few shared prefixes (so hits, junctions and shared pages happen)
    under tight pools: every step reads exactly the right tokens and states, the invariants
    hold after every step (no block leaked or counted twice, no checkpoint whose pages are
    gone, references and pins as the running sequences hold them), every request finishes,
    and nothing is held at the end."""
    sched, seqs = _run_workload(shared, requests, budget, max_seqs, extra_blocks, retention, kind)
    assert all(s.status is Status.FINISHED and s.num_output_tokens == s.params.max_tokens for s in seqs)
    _assert_all_returned(sched)
    for s in seqs:
        assert (
            s.num_cached_tokens is not None and s.num_cached_tokens % PAGE == 0 and s.num_cached_tokens < len(s.tokens)
        )


def test_a_broken_eviction_is_caught(monkeypatch):
    """An eviction that frees a checkpoint's blocks but leaves it readable must fail the
    checks above (a later hit reads blocks that now hold other data)."""

    def leaky_drop(self, ckpt):
        self.pool.give_back(ckpt.blocks)

    monkeypatch.setattr(PrefixCache, "_drop_checkpoint", leaky_drop)
    shared = [[1, 2, 3] * 5]
    requests = [(0, [k % 4] * 6, 4, None) for k in range(10)]
    with pytest.raises((AssertionError, RuntimeError)):  # the checks above, or the pool's own
        _run_workload(shared, requests, budget=16, max_seqs=2, extra_blocks=12, retention=None, kind="hybrid")


def _one(
    sched: Scheduler, device: FakeDevice, tokens: list[int], rid: str, max_tokens: int = 1, salt: str | None = None
) -> Sequence:
    seq = Sequence(rid, 0, list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), 0, cache_salt=salt)
    _drive(sched, device, [seq], {rid: [7] * max_tokens})
    return seq


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_dense_hybrid_hits_a_shared_prefix_from_the_second_request(budget):
    """A 202-token shared prefix then distinct questions: the first request's scan stores
    candidates at every page boundary, so the second hits at the largest one (200)."""
    sched, device = _scheduler(600, 4, budget), FakeDevice()
    system = [i % 97 for i in range(202)]
    hits = [_one(sched, device, system + [100 + r, 101, 102], str(r)).num_cached_tokens for r in range(4)]
    assert hits == [0, 200, 200, 200]


def test_dense_hybrid_hits_where_a_later_prompt_leaves_an_earlier_one():
    sched, device = _scheduler(600, 4, 64), FakeDevice()
    p = [i % 89 for i in range(300)]
    _one(sched, device, p + [1, 2], "a")
    assert _one(sched, device, p[:150] + [3, 3, 3], "b").num_cached_tokens == 148


def test_sparse_hybrid_hits_a_shared_prefix_from_the_third_request():
    """Sparse retention stores no candidates: the second request leaves a junction checkpoint
    where it left the first one's pages, and the third hits there."""
    sched, device = _scheduler(600, 4, 64, retention=checkpoint_policy.SPARSE), FakeDevice()
    system = [i % 97 for i in range(202)]
    hits = [_one(sched, device, system + [100 + r, 101, 102], str(r)).num_cached_tokens for r in range(4)]
    assert hits == [0, 0, 200, 200]
    assert sched.stats.tokens_lost == 200  # the second request matched 50 cached pages it could not use


def test_plain_transformer_hits_at_the_largest_full_page():
    sched, device = _scheduler(400, 4, 64, mamba=False), FakeDevice()
    first = [i % 251 for i in range(1000)]
    _one(sched, device, first + [1, 2, 3], "a")
    assert _one(sched, device, first + [4, 5], "b").num_cached_tokens == 1000
    assert sched.stats.tokens_lost == 0


def test_the_next_turn_hits_past_the_answer():
    sched, device = _scheduler(600, 4, 64), FakeDevice()
    a = _one(sched, device, [i % 53 for i in range(100)], "a", max_tokens=10)
    turn2 = a.tokens + [9, 9, 9]  # prompt + answer + a new message
    assert _one(sched, device, turn2, "b").num_cached_tokens == (len(a.tokens) - 1) // PAGE * PAGE


@pytest.mark.parametrize("retention", [checkpoint_policy.DENSE, checkpoint_policy.SPARSE])
def test_a_fresh_prompts_end_waits_as_a_candidate_until_a_request_comes_back(retention):
    """With dense retention a first turn's prompt end is a candidate (below all used content)
    while the rungs under it are used; the next turn comes back and its own end is used.
    Sparse retention has no rungs to fall back to: a fresh end is used at once."""
    sched, device = _scheduler(600, 4, 64, retention=retention), FakeDevice()
    a = _one(sched, device, [i % 53 for i in range(100)], "a", max_tokens=10)
    hits = {c.depth: c.hits for c in sched.cache.checkpoints.values()}
    dense = retention is checkpoint_policy.DENSE
    assert hits[100] == (0 if dense else 1)
    if dense:
        assert all(hits[d] >= 1 for d in (4, 8, 16, 32, 64))  # its ladder of rungs
    b = _one(sched, device, a.tokens + [9, 9, 9], "b")
    assert b.num_cached_tokens == 108  # past the answer
    assert {c.depth: c.hits for c in sched.cache.checkpoints.values()}[112] >= 2


def test_different_salts_share_nothing():
    sched, device = _scheduler(400, 4, 64), FakeDevice()
    prompt = list(range(50))
    _one(sched, device, prompt, "a", salt="x")
    assert _one(sched, device, prompt, "b", salt="x").num_cached_tokens > 0
    assert _one(sched, device, prompt, "c", salt="y").num_cached_tokens == 0
    assert _one(sched, device, prompt, "d").num_cached_tokens == 0


def test_cached_content_never_starves_admission():
    """Every block holds cache content, yet a long new request is admitted: it evicts what it needs."""
    sched, device = _scheduler(1 + 30, 1, 512, mamba=False), FakeDevice()
    for k in range(15):
        _one(sched, device, [k] * 8, str(k))  # leaves 2 full pages each
    assert sched.cache.pool.num_free == 0
    assert _one(sched, device, [42] * 100, "long").status is Status.FINISHED


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


@pytest.mark.parametrize("mamba", [True, False])
def test_a_last_token_that_completes_a_page_is_computed_for_the_next_turn(mamba):
    """A finished sequence of 12 tokens (prompt 9 + 3 sampled) computes its 12th token too, so
    the next turn hits all 3 pages instead of 2."""
    sched, device = _scheduler(200, 4, 64, mamba=mamba), FakeDevice()
    a = _one(sched, device, [3] * 9, "a", max_tokens=3)
    assert len(a.tokens) == 12 and a.num_computed == 12
    assert _one(sched, device, a.tokens + [5, 5], "b").num_cached_tokens == 12


def test_a_step_that_reads_a_checkpoint_is_not_a_decode_step():
    sched, device = _scheduler(200, 4, 64), FakeDevice()
    _one(sched, device, [3] * 9, "a")  # 9 tokens: a checkpoint at 8
    sched.add(Sequence("b", 0, [3] * 9, 9, SamplingParams(max_tokens=1), 0))
    step = sched.schedule()
    assert step.num_tokens == [1] and step.restores and not step.is_decode
