"""The prefix cache alone: lookup, the single block budget and the eviction order."""

import pytest

from jaxengine.cache.block_hash import extend_hashes, root_hash
from jaxengine.cache.block_pool import BlockPool
from jaxengine.cache.prefix_cache import PrefixCache
from jaxengine.cache.reuse_model import JUNCTION, PASSED, PROMPT, REUSES, RUNG, TRAILING, hit_class

PAGE = 2
CKPT = 2  # blocks per checkpoint


def _saved_per_block(depth: int, above: int, frees_pages: bool) -> float:
    """A checkpoint's value in these tests: tokens saved over the one above per block freed."""
    return (depth - above) / (CKPT + ((depth - above) // PAGE if frees_pages else 0))


def _cache(num_blocks: int, *, recurrent: bool = True, has_kv: bool = True) -> PrefixCache:
    return PrefixCache(
        BlockPool(num_blocks),
        page_size=PAGE,
        has_kv=has_kv,
        checkpoint_blocks=CKPT if recurrent else 0,
        value=lambda depth: float(depth),
        checkpoint_value=_saved_per_block,
    )


def _register(cache: PrefixCache, tokens: list[int]) -> tuple[list[bytes], list[int]]:
    """Registers `tokens`' full pages as a running sequence computes them (in blocks it holds,
    or none for a model without attention layers); returns the page hashes and the blocks."""
    hashes = extend_hashes([], tokens, PAGE, root_hash(None))
    blocks = cache.allocate(len(hashes)) if cache.has_kv else [0] * len(hashes)
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        cache.register(block, h, hashes[i - 1] if i else None, (i + 1) * PAGE, 1)
    return hashes, blocks


def _store(cache: PrefixCache, tokens: list[int], checkpoint_at: list[int], hits: int = 1) -> list[bytes]:
    """Registers `tokens`' full pages as a finished sequence leaves them, with checkpoints
    (of `hits`) after the given numbers of tokens; returns the page hashes."""
    hashes, blocks = _register(cache, tokens)
    for depth in checkpoint_at:
        ckpt_blocks = cache.reserve_checkpoint(depth, TRAILING, hits)
        assert ckpt_blocks is not None
        cache.commit(ckpt_blocks, hashes[depth // PAGE - 1], TRAILING, hits)
    cache.release(blocks)
    cache.check_invariants()
    return hashes


def test_a_hit_needs_all_pages_and_a_checkpoint_at_its_end():
    cache = _cache(40)
    hashes = _store(cache, list(range(12)), [4, 10])
    match = cache.match(hashes[:4])  # 8 tokens cached, checkpoints at 4 and 10
    assert (match.hit_pages, match.reach_pages) == (2, 4) and match.checkpoint.depth == 4
    assert [n.block_hash for n in match.nodes] == hashes[:2]
    assert cache.match(hashes).hit_pages == 5
    other = extend_hashes([], list(range(12)), PAGE, root_hash("salt"))
    assert cache.match(other).reach_pages == 0


def test_attention_only_hits_every_cached_page():
    cache = _cache(40, recurrent=False)
    hashes = _store(cache, list(range(12)), [])
    assert cache.match(hashes[:4]).hit_pages == 4


def test_dead_pages_go_first_then_the_lowest_ranked_checkpoint_with_its_pages():
    """Pages past the deepest checkpoint of a path can never be hit, so they go before any
    checkpoint; evicting a checkpoint makes the pages only it used dead, and they go next."""
    cache = _cache(1 + 12 + 2 * CKPT)
    a = _store(cache, [1] * 12, [4])  # 6 pages, 2 of them (4..7) below the checkpoint, 4 past it
    b = _store(cache, [2] * 12, [12])
    assert cache.pool.num_free == 0
    cache.allocate(4)  # the 4 dead pages of `a`
    assert cache.match(a[:2]).hit_pages == 2 and len(cache.checkpoints) == 2
    cache.allocate(4)  # next a checkpoint (a's: shallower, ranked lower), then a's pages with it
    assert cache.match(a).reach_pages == 0 and cache.match(b).hit_pages == 6
    cache.check_invariants()


def test_a_speculative_checkpoint_only_displaces_speculative_ones():
    cache = _cache(1 + 6 + 2 * CKPT)
    used = _store(cache, [1] * 6, [6])
    _store(cache, [2] * 6, [6], hits=0)  # speculative
    assert cache.pool.num_free == 0
    reserved = []
    while (blocks := cache.reserve_checkpoint(4, JUNCTION, 0)) is not None:
        reserved.append(blocks)  # the speculative checkpoint's blocks, then its dead pages
    assert len(reserved) == 2 and cache.counters.checkpoints_skipped == 1
    assert list(cache.checkpoints) == [used[-1]] and cache.match(used).hit_pages == 3
    for blocks in reserved:
        cache.cancel(blocks)
    cache.check_invariants()


def test_running_sequences_can_take_every_cached_block():
    cache = _cache(1 + 6 + CKPT)
    _store(cache, [1] * 12, [12])
    assert cache.pool.num_free == 0
    assert cache.allocate(8) is not None and not cache.checkpoints and not cache.nodes
    assert cache.allocate(1) is None


def test_a_pinned_checkpoint_is_not_evicted():
    cache = _cache(1 + 6 + CKPT)
    hashes = _store(cache, [1] * 12, [12])
    match = cache.match(hashes[:5])
    cache.acquire(match)  # pins the checkpoint at 10? no: the deepest at or below 10 tokens
    assert match.checkpoint is None and match.hit_pages == 0
    match = cache.match(hashes)
    cache.acquire(match)
    assert cache.allocate(1) is None  # everything is held or pinned
    cache.release([n.block for n in match.nodes])
    cache.unpin(match.checkpoint)
    assert cache.allocate(1) is not None


def test_a_dead_cached_page_is_replaced_by_a_running_sequences_copy():
    cache = _cache(20)
    hashes = _store(cache, [1] * 4, [])  # 2 pages, no checkpoint: dead
    block = cache.allocate(1)[0]
    cache.register(block, hashes[0], None, PAGE, 1)
    assert cache.nodes[hashes[0]].block == block
    cache.check_invariants()


def test_double_release_is_refused():
    cache = _cache(5)
    blocks = cache.allocate(2)
    cache.release(blocks)
    with pytest.raises(RuntimeError, match="not referenced"):
        cache.release(blocks[:1])
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_a_path_end_is_worth_its_whole_prefix_and_one_above_others_what_it_saves_over_the_next():
    """A checkpoint that ends its path is worth the whole prefix per byte of it and its pages;
    one with checkpoints below it frees only its own blocks and saves only what lies between
    it and the nearest one above, where its hits would resume. So a checkpoint a page below
    another goes first, however deep, and a shared prefix's stays."""
    cache = _cache(1 + 6 + 4 + 4 * CKPT)
    path = _store(cache, [1] * 12, [8, 10, 12])  # 6 pages, checkpoints at 8, 10 and 12
    other = _store(cache, [2] * 8, [8])  # 4 pages, a checkpoint at 8
    assert cache.pool.num_free == 0
    density = cache.model.density(hit_class(TRAILING, 1), 0)
    at8, at10, at12 = (cache.checkpoints[path[k]] for k in (3, 4, 5))
    assert cache.rank(at8) == (density * (8 / CKPT), 1)  # none above it
    assert cache.rank(at10) == (density * (2 / CKPT), 1)  # 2 tokens over the one at 8
    assert cache.rank(at12) == (density * (12 / (CKPT + 6)), 1)  # the path's end
    assert cache.rank(cache.checkpoints[other[-1]]) == (density * (8 / (CKPT + 4)), 1)
    cache.allocate(CKPT)  # the lowest: the one at 10, its pages held for the one at 12
    assert set(cache.checkpoints) == {path[3], path[5], other[-1]} and not cache._dead
    assert at12.above is at8
    cache.now += 1  # the next request: ranks recomputed alike with what the evictions taught
    cache.allocate(CKPT + 4)  # next the other path's end (8 / 6), then its pages
    assert set(cache.checkpoints) == {path[3], path[5]}
    cache.check_invariants()


def test_a_prompt_end_decoded_past_is_ranked_as_such_and_may_go_before_those_below():
    cache = _cache(1 + 6 + 2 * CKPT)
    hashes, blocks = _register(cache, [1] * 12)
    for depth, origin in ((8, PROMPT), (12, TRAILING)):
        cache.commit(cache.reserve_checkpoint(depth, origin, 1), hashes[depth // PAGE - 1], origin, 1)
    cache.release(blocks)
    prompt = cache.checkpoints[hashes[3]]
    cache.decoded_past(hashes[3])
    assert prompt.origin == PASSED and prompt.hits == 1
    cache.decoded_past(hashes[5])  # a decode boundary is not a prompt end: unchanged
    assert cache.checkpoints[hashes[5]].origin == TRAILING


def test_a_candidate_resumed_from_on_a_path_nothing_branches_from_is_passed_else_a_junction():
    """A request that hits a candidate and goes on past it along cached pages of a path nothing
    branches from resumes that path (like a conversation's next turn): the candidate becomes a
    checkpoint requests went past, ranked by how often those get reused, and the request
    continues it. Where the request's path leaves the cached pages at the candidate, or other
    paths branch from it, it is a junction."""
    cache = _cache(1 + 8 + 3 * CKPT)
    hashes, blocks = _register(cache, [1] * 12)
    for depth, origin, hits in ((4, JUNCTION, 0), (8, JUNCTION, 0), (12, PROMPT, 1)):  # candidates at 4, 8
        cache.commit(cache.reserve_checkpoint(depth, origin, hits), hashes[depth // PAGE - 1], origin, hits)
    cache.release(blocks)
    resumed = extend_hashes([], [1] * 10 + [3] * 4, PAGE, root_hash(None))  # parts after 5 pages
    match = cache.match(resumed)
    assert (match.hit_pages, match.reach_pages) == (4, 5)
    assert cache.record_hit(match) == (1, True)
    candidate = cache.checkpoints[hashes[3]]
    assert candidate.origin == PASSED and candidate.node.visible_below == 1
    branched = extend_hashes([], [1] * 4 + [2] * 8, PAGE, root_hash(None))  # parts at the candidate
    match = cache.match(branched)
    assert (match.hit_pages, match.reach_pages) == (2, 2)
    assert cache.record_hit(match) == (1, False)
    assert cache.checkpoints[hashes[1]].origin == JUNCTION
    cache.check_invariants()

    cache = _cache(1 + 8 + 2 * CKPT)
    hashes, blocks = _register(cache, [1] * 12)
    cache.commit(cache.reserve_checkpoint(4, JUNCTION, 0), hashes[1], JUNCTION, 0)
    cache.release(blocks)
    cache.release(_register(cache, [1] * 4 + [5] * 4)[1])  # another path branches at the candidate
    match = cache.match(extend_hashes([], [1] * 6 + [3] * 4, PAGE, root_hash(None)))
    assert (match.hit_pages, match.reach_pages) == (2, 3) and match.checkpoint.node.children == 2
    assert cache.record_hit(match) == (1, False)
    assert match.checkpoint.origin == JUNCTION


def test_a_checkpoint_reranked_when_one_below_starts_or_stops_holding_its_pages():
    cache = _cache(1 + 6 + 2 * CKPT)
    hashes, blocks = _register(cache, [1] * 12)
    cache.commit(cache.reserve_checkpoint(4, RUNG, 1, ends_path=False), hashes[1], RUNG, 1)
    cache._refresh_ranks()  # ranked in this clock tick, alone on its path
    cache.commit(cache.reserve_checkpoint(12, PROMPT, 1), hashes[5], PROMPT, 1)  # a later chunk
    cache.release(blocks)
    cache.check_invariants()
    rung, prompt = cache.checkpoints[hashes[1]], cache.checkpoints[hashes[5]]
    assert rung.node.visible_below == 1 and prompt.above is rung
    density = cache.model.density(hit_class(RUNG, 1), 0)
    assert cache.rank(rung) == (density * (4 / CKPT), 1)  # the prompt end below holds its pages
    # The eviction order has it at that rank in the same tick: a checkpoint ranked between its
    # rank alone (4 / 4) and the prompt end's (12 / 8) finds nothing it may displace.
    assert cache.pool.num_free == 0
    assert cache.reserve_checkpoint(10, PROMPT, 1) is None  # 10 / 7
    assert hashes[1] in cache.checkpoints
    cache._drop_checkpoint(prompt)
    assert cache.rank(rung) == (density * (4 / (CKPT + 2)), 1)  # alone on its path: its pages are its own


def test_without_attention_layers_a_checkpoint_frees_only_its_own_blocks():
    cache = _cache(1 + 2 * CKPT, has_kv=False)
    hashes, _ = _register(cache, [1] * 12)
    cache.commit(cache.reserve_checkpoint(12, PROMPT, 1), hashes[5], PROMPT, 1)
    prompt = cache.checkpoints[hashes[5]]
    assert prompt.node.visible_below == 0  # the deepest, yet no pages to free
    assert cache.rank(prompt) == (cache.model.density(hit_class(PROMPT, 1), 0) * 12 / CKPT, 1)


def test_a_hit_on_a_rung_is_counted_as_a_rungs_reuse_and_makes_it_a_junction():
    cache = _cache(1 + 6 + 2 * CKPT)
    hashes, blocks = _register(cache, [1] * 12)
    cache.commit(cache.reserve_checkpoint(4, RUNG, 1), hashes[1], RUNG, 1)
    cache.release(blocks)
    for _ in range(3):
        cache.now += 1
    before = cache.model.counts[hit_class(RUNG, 1), REUSES].sum()
    other = extend_hashes([], [1] * 6 + [2] * 6, PAGE, root_hash(None))  # leaves after 3 pages
    match = cache.match(other)
    assert match.checkpoint is cache.checkpoints[hashes[1]] and match.hit_pages == 2
    hits, continues = cache.record_hit(match)
    assert (hits, continues) == (1, False)  # a branch off it starts a new prefix
    assert match.checkpoint.origin == JUNCTION and match.checkpoint.hits == 2
    assert cache.model.counts[hit_class(RUNG, 1), REUSES].sum() == pytest.approx(before + 1)


def test_a_checkpoint_left_out_for_want_of_room_teaches_the_ranking_when_wanted():
    cache = _cache(1 + 6 + CKPT)
    _store(cache, [1] * 12, [12], hits=3)
    wanted = extend_hashes([], [2] * 12, PAGE, root_hash(None))
    cls = hit_class(JUNCTION, 1)
    before = cache.model.density(cls, 5)
    assert cache.reserve_checkpoint(4, JUNCTION, 1, wanted[1]) is None  # the used one ranks higher
    assert wanted[1] in cache.model.ghosts
    for _ in range(5):
        cache.now += 1
    cache.match(wanted)  # a request that would have hit it
    assert wanted[1] not in cache.model.ghosts and cache.model.density(cls, 5) > before


def test_a_checkpoint_is_counted_only_up_to_the_nearest_checkpoint_above():
    # What is below a checkpoint is seen from above as that checkpoint alone, so writing or
    # dropping one walks to the nearest checkpoint above, not to the root (a long context's
    # decode writes one at every page).
    cache = _cache(1 + 12 + 3 * CKPT)
    hashes = _store(cache, list(range(24)), [8])
    top, mid, leaf = (cache.nodes[hashes[k]] for k in (1, 3, 11))
    assert top.visible_below == 1 and mid.visible_below == 0
    cache.commit(cache.reserve_checkpoint(24, TRAILING, 1), hashes[11], TRAILING, 1)
    assert top.visible_below == 1  # it sees the checkpoint at 8 only, not the one past it
    assert mid.visible_below == 1 and cache.nodes[hashes[7]].visible_below == 1
    assert leaf.checkpoint.above is mid.checkpoint and list(mid.checkpoint.under) == [leaf.checkpoint]
    cache.check_invariants()
    cache._drop_checkpoint(mid.checkpoint)  # the one at 24 is now the nearest below the root
    assert top.visible_below == 1 and mid.visible_below == 1 and not cache._dead
    assert leaf.checkpoint.above is None
    cache.check_invariants()
    cache._drop_checkpoint(leaf.checkpoint)  # nothing below: every page is dead, the leaf first
    assert top.visible_below == 0 and list(cache._dead) == [leaf]
    cache.check_invariants()


def test_a_checkpoint_written_above_others_becomes_where_they_resume():
    """Written where paths with checkpoints below part, it is the nearest checkpoint above each
    of them; a path that does not pass it keeps its own. A checkpoint that then finds itself
    with none above saves its whole prefix."""
    cache = _cache(1 + 16 + 4 + 5 * CKPT)  # 16 cached pages, 4 a running request holds
    left = _store(cache, [1] * 8 + [2] * 8, [12, 16])
    right = _store(cache, [1] * 8 + [3] * 8, [16])
    apart = _store(cache, [4] * 8, [8])
    shared, blocks = _register(cache, [1] * 8)  # the shared 4 pages, as a running request holds them
    cache.commit(cache.reserve_checkpoint(8, JUNCTION, 2, ends_path=False), shared[-1], JUNCTION, 2)
    cache.release(blocks)
    junction, mid = cache.checkpoints[shared[-1]], cache.checkpoints[left[5]]
    assert mid.above is junction and cache.checkpoints[right[-1]].above is junction
    assert cache.checkpoints[left[-1]].above is mid
    assert cache.checkpoints[apart[-1]].above is None and junction.above is None
    density = cache.model.density(hit_class(TRAILING, 1), 0)
    assert cache.rank(mid) == (density * (4 / CKPT), 1)  # 4 tokens over the junction
    cache.check_invariants()
    cache._drop_checkpoint(junction)
    assert mid.above is None and cache.rank(mid) == (density * (12 / CKPT), 1)
    cache.check_invariants()
