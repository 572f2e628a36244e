"""The prefix cache: full KV pages and recurrent-state checkpoints under one block budget.

What it holds, all in blocks of one `BlockPool`:
  * a *node* per full page of a cached prefix, named by the page's chained block hash
    (`block_hash.py`): the page's KV block (none for a model without attention layers) and
    a link to the node of the page before it, so the nodes form a tree of prefixes;
  * *checkpoints*: the recurrent state (every recurrent layer's) after exactly the tokens of
    a node's prefix, spanning `checkpoint_blocks` blocks.

A *hit* is the longest prefix of a request whose pages are all cached and, for a model with
recurrent layers, that has a checkpoint at exactly its end. The places a hit can end are the
*hit points*: checkpoints, or every page for an attention-only model.

Blocks held by running sequences are theirs; every other block is cache content, evicted
when blocks are needed, in this order:
  1. *dead pages* (models with recurrent layers): a page with no checkpoint at or below it in
     the tree can never produce a hit. Leaves go first, least recently released first.
  2. *speculative* checkpoints (used 0 times: dense candidates, and with dense retention the
     prompt end of a prefix no request has come back to yet), oldest first.
  3. used hit points (checkpoints, or leaf pages of an attention-only model), lowest rank
     first, ranked by `reuse_model.ReuseModel`: expected saved compute per byte per request
     of waiting, learned online from when hit points of each kind got reused. A checkpoint
     that ends its path is worth the whole prefix it saves per byte of it and its pages. One
     with checkpoints below it frees only its own blocks when it goes (its pages are held for
     those below), and its hits lose only what it saves over the nearest checkpoint above it,
     where they would resume: it is worth that per byte of its own (Marconi's FLOP efficiency
     of a radix node). So a checkpoint a page below another goes early however deep it is,
     and a path that requests leave at every page keeps its pages and a sparse ladder of
     checkpoints rather than a few whole paths dense with them, while a shared prefix's
     checkpoint, which every request on it falls back to, costs little and stays.
When a checkpoint goes, the pages that only it made reachable become dead, so a cold chain
goes whole before the tails of other chains.

A new checkpoint only evicts content ranked at or below its own prospective rank: a
speculative one only ever displaces speculative ones (or dead pages, or free blocks), so
dense candidates fill room that used content does not need and never flood it. A request
that diverges at one of them hits there, which makes it used: a junction. One that resumes
there and goes on along the cached pages of a path nothing branches from (the path's deeper
checkpoint is gone) continues that path: its own edge checkpoint supersedes the candidate
again, as a conversation's next turn supersedes the one it resumed from.

Where checkpoints are written is the scheduler's (`checkpoint_policy.plan`), from what the
cache knows of where prefixes part: the shape of recently seen prefixes, kept after their
pages are evicted (`prefix_shape.py`), and the page multiple they part at
(`divergence_grain.py`).
"""

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable

from jaxengine.cache.block_pool import BlockPool
from jaxengine.cache.divergence_grain import DivergenceGrain
from jaxengine.cache.prefix_shape import PrefixShape
from jaxengine.cache.reuse_model import JUNCTION, PAGE, PASSED, PROMPT, RUNG, ReuseModel, hit_class

NO_FLOOR = (float("inf"), 0)  # running sequences' pages may evict any cache content
SPECULATIVE = (-1.0, 0)  # the rank of every speculative hit point: below all used content


@dataclasses.dataclass(eq=False)
class Node:
    """One full page of a cached prefix."""

    block_hash: bytes
    parent: "Node | None"
    depth: int  # tokens from the start of the prefix to the end of this page
    block: int  # its KV block; 0 for a model without attention layers
    children: int = 0  # registered pages that continue this prefix
    checkpoint: "Checkpoint | None" = None
    # Checkpoints under this node (not at it) with none between them and it: more than 0 says
    # a checkpoint is below; counted only to the nearest checkpoint above (`_add_visible`).
    visible_below: int = 0
    # Use counts; ranked by them when pages are the hit points (attention-only models).
    origin: int = PAGE
    hits: int = 1
    last_use: int = 0  # request clock
    version: int = 0


@dataclasses.dataclass(eq=False)
class Checkpoint:
    """The recurrent state after exactly `node.depth` tokens of `node`'s prefix."""

    node: Node
    blocks: list[int]
    origin: int  # where it came from: `reuse_model.PROMPT`, `JUNCTION`, `TRAILING`, `PASSED` or `RUNG`
    hits: int
    last_use: int  # request clock
    pins: int = 0  # steps about to read it
    version: int = 0
    # The nearest checkpoint above it on its path (None: none), where its hits resume without
    # it, and the checkpoints whose nearest one above it is (a dict: an order that repeats).
    above: "Checkpoint | None" = None
    under: dict["Checkpoint", None] = dataclasses.field(default_factory=dict)

    @property
    def depth(self) -> int:
        return self.node.depth


@dataclasses.dataclass
class Match:
    """A lookup's result: the hit, and how far cached pages reached beyond it."""

    nodes: list[Node]  # the pages of the hit (empty for a model without attention layers)
    hit_pages: int
    reach_pages: int  # consecutive cached pages of the request's prefix, hit or not
    checkpoint: Checkpoint | None  # where the hit resumes (models with recurrent layers)
    # Pages of the request's prefix that an earlier request computed, cached or not, when it
    # goes on past them (0 otherwise): where it parts from known prefixes (`prefix_shape`).
    parted_at: int = 0
    # Depth (pages) -> uses so far, where known prefixes on the request's path part, it included.
    junctions: dict[int, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class CacheCounters:
    """Evictions and checkpoints since start."""

    pages_evicted: int = 0
    checkpoints_evicted: int = 0
    checkpoints_written: int = 0
    checkpoints_skipped: int = 0  # not written: no room at their rank


class PrefixCache:
    """Cached pages and checkpoints over a block pool, with their eviction order.

    `value(depth)` is what a hit on a cached page at `depth` tokens saves per byte held (any
    unit; models without recurrent layers), `checkpoint_value(depth, above, frees_pages)` what
    a checkpoint saves over the nearest one above it per byte its eviction frees
    (`hit_value.ModelCosts`); `checkpoint_blocks` is 0 for a model without recurrent layers,
    `has_kv` False for a model without attention layers (its nodes then hold no block)."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        page_size: int,
        has_kv: bool,
        checkpoint_blocks: int,
        value: Callable[[int], float],
        checkpoint_value: Callable[[int, int, bool], float],
        enabled: bool = True,
    ):
        self.pool = pool
        self.page_size = page_size
        self.has_kv = has_kv
        self.checkpoint_blocks = checkpoint_blocks
        self.value = value
        self.checkpoint_value = checkpoint_value
        self.enabled = enabled
        self.nodes: dict[bytes, Node] = {}
        self.node_of_block: dict[int, Node] = {}
        self.checkpoints: dict[bytes, Checkpoint] = {}
        self._tops: dict[Checkpoint, None] = {}  # checkpoints with none above them
        self.pending: set[int] = set()  # blocks of checkpoints a step is writing
        self.now = 0  # requests admitted: the clock hit-point ages are counted in
        self.model = ReuseModel(max_ghosts=max(256, pool.num_blocks))
        self.divergences = DivergenceGrain()
        self.shape = PrefixShape(max_pages=max(1 << 16, 16 * pool.num_blocks))
        self.counters = CacheCounters()
        # Dead leaves (no checkpoint at or below, no children, not held by a running sequence),
        # least recently released first. Only kept for models with recurrent layers.
        self._dead: collections.OrderedDict[Node, None] = collections.OrderedDict()
        self._max_dead_nodes = 16 * pool.num_blocks  # block-less nodes free nothing; cap them
        self._heap: list[tuple[tuple[float, int], int, int, Node | Checkpoint]] = []  # (rank, order, version, point)
        self._heap_time = -1  # the clock its ranks were computed at
        self._order = itertools.count()

    @property
    def recurrent(self) -> bool:
        return self.checkpoint_blocks > 0

    # ------------------------------------------------------------------ priorities

    def rank(self, hit_point: Node | Checkpoint) -> tuple[float, int]:
        """What keeping it is worth: expected saved compute per byte per request of waiting,
        then its use count (more used wins a tie). Speculative hit points rank below all."""
        if hit_point.hits == 0:
            return SPECULATIVE
        age = self.now - hit_point.last_use
        cls = hit_class(hit_point.origin, hit_point.hits)
        if isinstance(hit_point, Checkpoint):
            above = hit_point.above.depth if hit_point.above is not None else 0
            value = self._checkpoint_value(hit_point.depth, above, not hit_point.node.visible_below)
        else:
            value = self.value(hit_point.depth)
        return self.model.density(cls, age) * value, hit_point.hits

    def prospective_rank(self, depth: int, origin: int, hits: int, ends_path: bool, above: int) -> tuple[float, int]:
        """The rank a checkpoint written now at `depth` would get: what writing it adds, the
        compute between it and `above` (the nearest checkpoint above it, where its hits would
        otherwise resume) per byte of it and, if it ends its path, of the pages between the two,
        which only it would keep. Once written it is ranked as any other (`rank`)."""
        if hits == 0:
            return SPECULATIVE
        value = self.checkpoint_value(depth, above, self.has_kv and ends_path)
        return self.model.density(hit_class(origin, hits), 0) * value, hits

    def _checkpoint_value(self, depth: int, above: int, ends_path: bool) -> float:
        """What keeping a checkpoint at `depth` saves per byte. One that ends its path (no
        checkpoint below it) is worth the whole prefix per byte of it and its pages: when it
        goes its pages go, and the checkpoints above it, kept for it, are path ends in turn.
        One with checkpoints below it frees only its own blocks (its pages are held for them)
        and loses only what it saves over `above`, the nearest checkpoint above it, where its
        hits would resume (`hit_value.ModelCosts.checkpoint_value`)."""
        if ends_path:
            return self.checkpoint_value(depth, 0, self.has_kv)
        return self.checkpoint_value(depth, above, False)

    def _push(self, hit_point: Node | Checkpoint) -> None:
        hit_point.version += 1
        heapq.heappush(self._heap, (self.rank(hit_point), next(self._order), hit_point.version, hit_point))

    def _refresh_ranks(self) -> None:
        """Ranks move with age: recomputed once per clock tick, when eviction needs them."""
        if self._heap_time == self.now:
            return
        self._heap_time = self.now
        self._heap = []
        if self.recurrent:
            points: list = [c for c in self.checkpoints.values() if c.pins == 0]
        else:
            points = [n for n in self.nodes.values() if self._evictable(n)]
        for hit_point in points:
            self._push(hit_point)

    def _evictable(self, hit_point: Node | Checkpoint) -> bool:
        if isinstance(hit_point, Checkpoint):
            return self.checkpoints.get(hit_point.node.block_hash) is hit_point and hit_point.pins == 0
        return (
            self.nodes.get(hit_point.block_hash) is hit_point
            and hit_point.children == 0
            and hit_point.block not in self.pool.ref_count
        )

    def _lowest(self) -> Node | Checkpoint | None:
        """The evictable hit point ranked lowest (stale heap entries are dropped)."""
        while self._heap:
            _, _, version, hit_point = self._heap[0]
            if hit_point.version == version and self._evictable(hit_point):
                return hit_point
            heapq.heappop(self._heap)
        return None

    # ------------------------------------------------------------------ lookup and hits

    def match(self, hashes: list[bytes]) -> Match:
        """The longest hit among the prefixes named by `hashes` (nothing is taken)."""
        if not self.enabled:
            return Match([], 0, 0, None)
        nodes = []
        for h in hashes:
            node = self.nodes.get(h)
            if node is None:
                break
            nodes.append(node)
        reach = len(nodes)
        walk = self.shape.walk(hashes)
        known = max(reach, walk.seen)
        parted = known if known < len(hashes) else 0
        junctions = dict(walk.branches)
        if parted and reach > walk.seen and nodes[-1].children:  # the shape forgot a cached path
            junctions[reach] = 2
        match = Match(nodes, reach, reach, None, parted, junctions)
        if self.recurrent:
            match = Match([], 0, reach, None, parted, junctions)
            for j in range(reach, 0, -1):
                ckpt = nodes[j - 1].checkpoint
                if ckpt is not None:
                    match = Match(nodes[:j] if self.has_kv else [], j, reach, ckpt, parted, junctions)
                    break
        # A deeper hit point that was evicted: the model learns it was reused after all.
        for h in reversed(hashes[match.hit_pages :]):
            if self.model.ghost_hit(h, self.now):
                break
        return match

    def acquire(self, match: Match) -> None:
        """Takes the hit's pages for a running sequence and pins its checkpoint until the
        sequence's first step has read it (`release` the pages, `unpin` the checkpoint)."""
        for node in match.nodes:
            self.pool.reference(node.block)
            self._dead.pop(node, None)
        if match.checkpoint is not None:
            match.checkpoint.pins += 1
            match.checkpoint.version += 1  # not evictable while pinned; re-queued by `unpin`

    def record_hit(self, match: Match) -> tuple[int, bool]:
        """Counts an admitted request (the clock) and its use of the hit. Returns the hit count
        the sequence's own checkpoints and pages start with, and whether it *continues* the
        hit: it resumes where an earlier sequence stopped decoding and nothing else continues
        there (a conversation's next turn, or a request that resumes at a candidate on a path
        nothing branches from and goes on along its cached pages). Then it carries on the
        hit's count, else it starts from 1 (a branch off a shared prefix is a new prefix)."""
        self.now += 1
        if match.parted_at:
            self.divergences.observe(match.parted_at)
        point = match.checkpoint if match.checkpoint is not None else (match.nodes[-1] if match.nodes else None)
        if point is None:
            return 1, False
        self.model.reused(hit_class(point.origin, point.hits), self.now - point.last_use)
        if isinstance(point, Checkpoint) and (point.hits == 0 or point.origin == RUNG):
            # A candidate or rung found its use: prefixes branch there (a junction). Unless a
            # candidate (or a superseded edge) is on a path nothing branches from and the
            # request goes on past it along pages an earlier request left: then it resumes
            # that path here, like a conversation's next turn at its last checkpoint; its own
            # edge supersedes this one later (`supersede`), until then one requests went past.
            resumes = point.hits == 0 and match.reach_pages > match.hit_pages and point.node.children == 1
            point.origin = PASSED if resumes else JUNCTION
        for p in [match.checkpoint] if match.checkpoint is not None else match.nodes:
            p.hits += 1
            p.last_use = self.now
        if isinstance(point, Checkpoint):
            continues = point.origin != JUNCTION
        else:
            continues = point.children == 0
        return (point.hits if continues else 1), continues

    def unpin(self, ckpt: Checkpoint) -> None:
        ckpt.pins -= 1
        if ckpt.pins == 0 and self.checkpoints.get(ckpt.node.block_hash) is ckpt:
            self._push(ckpt)

    def supersede(self, block_hash: bytes) -> None:
        """A deeper checkpoint of the same sequence took over this one's use (a conversation
        moved on): it keeps its place only as a speculative checkpoint (hits 0), unless
        prefixes branch at it."""
        ckpt = self.checkpoints.get(block_hash)
        if ckpt is None or ckpt.node.children > 1 or ckpt.hits == 0:
            return
        ckpt.hits = 0
        self._requeue(ckpt)

    def decoded_past(self, block_hash: bytes) -> None:
        """The sequence that wrote this prompt-end checkpoint has decoded past it. Whether its
        next turn resumes after the answer (requests that carry the answer on) or here
        (traffic whose prefixes match only in whole blocks, where an answer's pages are never
        reached again) is the workload's to say: from now on it is ranked by how often such
        checkpoints get reused (`reuse_model.PASSED`)."""
        ckpt = self.checkpoints.get(block_hash)
        if ckpt is None or ckpt.hits == 0 or ckpt.origin != PROMPT:
            return
        ckpt.origin = PASSED
        self._requeue(ckpt)

    def _requeue(self, ckpt: Checkpoint) -> None:
        """Its rank changed: a fresh age, and a new place in the eviction order."""
        ckpt.last_use = self.now
        if ckpt.pins == 0:
            self._push(ckpt)
        else:
            ckpt.version += 1

    # ------------------------------------------------------------------ blocks for running sequences

    def allocate(self, n: int) -> list[int] | None:
        """`n` blocks for a running sequence (referenced once), evicting any cache content
        needed; None if even that cannot free enough."""
        if not self._make_room(n, NO_FLOOR):
            return None
        blocks = self.pool.take(n)
        for block in blocks:
            self.pool.reference(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """A running sequence drops its blocks: registered pages stay cached, others are freed."""
        for block in blocks:
            if not self.pool.unreference(block):
                continue
            node = self.node_of_block.get(block)
            if node is None:
                self.pool.give_back([block])
            elif self.recurrent:
                self._maybe_dead(node)
            elif node.children == 0:
                self._push(node)

    def register(self, block: int, block_hash: bytes, parent_hash: bytes | None, depth: int, hits: int) -> None:
        """Records that a running sequence's page `block` (0 without attention layers) now
        holds exactly the tokens of `block_hash`. If a dead cached page holds them already,
        it is replaced by this one; if a live one does, this one stays private."""
        if not self.enabled:
            return
        self.shape.add(block_hash, parent_hash)
        parent = self.nodes.get(parent_hash) if parent_hash is not None else None
        if parent_hash is not None and parent is None:
            return  # its prefix is no longer cached: this page could never be reached
        node = self.nodes.get(block_hash)
        if node is not None:
            if block and block != node.block and _unreachable(node) and node.block not in self.pool.ref_count:
                self._dead.pop(node, None)
                del self.node_of_block[node.block]
                self.pool.give_back([node.block])
                node.block = block
                self.node_of_block[block] = node
            return
        node = Node(block_hash, parent, depth, block, hits=hits, last_use=self.now)
        self.nodes[block_hash] = node
        if block:
            self.node_of_block[block] = node
        if parent is not None:
            parent.children += 1
            self._dead.pop(parent, None)
        if not block:
            self._maybe_dead(node)

    # ------------------------------------------------------------------ checkpoints

    def depth_above(self, hashes: list[bytes], pages: int) -> int:
        """The depth of the nearest cached checkpoint above the prefix of `pages` pages that
        `hashes` name (0: none): where hits at that prefix resume without a checkpoint there."""
        for k in range(min(pages - 1, len(hashes)), 0, -1):
            ckpt = self.checkpoints.get(hashes[k - 1])
            if ckpt is not None:
                return ckpt.depth
        return 0

    def reserve_checkpoint(
        self,
        depth: int,
        origin: int,
        hits: int,
        block_hash: bytes | None = None,
        *,
        ends_path: bool = True,
        above: int = 0,
    ) -> list[int] | None:
        """Blocks for a checkpoint at `depth` (the prefix `block_hash` names) that a step will
        write, or None when making room would evict content ranked higher than it. Commit or
        cancel them. `ends_path`: whether it will end its path (a prompt end, a decode
        boundary); `above`: the depth of the nearest checkpoint above it (`depth_above`). A
        used-class checkpoint left out is remembered as a ghost, evicted at birth, so that a
        request that would have hit it teaches the ranking it was wanted."""
        if not self.enabled or not self.recurrent:
            return None
        floor = self.prospective_rank(depth, origin, hits, ends_path, above)
        if not self._make_room(self.checkpoint_blocks, floor):
            self.counters.checkpoints_skipped += 1
            if block_hash is not None:
                self.model.died(block_hash, hit_class(origin, hits), 0, self.now)
            return None
        blocks = self.pool.take(self.checkpoint_blocks)
        self.pending.update(blocks)
        return blocks

    def cancel(self, blocks: list[int]) -> None:
        """Gives back a reservation whose content is not kept (its step did not run, or
        wrote it after a rejected draft)."""
        self.pending.difference_update(blocks)
        self.pool.give_back(blocks)

    def cancel_all_pending(self) -> None:
        """Gives back every reservation (after a step that failed)."""
        self.cancel(sorted(self.pending))

    def clear(self) -> None:
        """Forgets all cache content (the device lost it); blocks held by running sequences
        must have been released first."""
        if self.pool.ref_count:
            raise RuntimeError("clearing the prefix cache while running sequences hold blocks")
        self.cancel_all_pending()
        blocks = [b for c in self.checkpoints.values() for b in c.blocks] + list(self.node_of_block)
        self.pool.give_back(blocks)
        self.nodes.clear()
        self.node_of_block.clear()
        self.checkpoints.clear()
        self._tops.clear()
        self._dead.clear()
        self._heap.clear()

    def commit(self, blocks: list[int], block_hash: bytes, origin: int, hits: int) -> Checkpoint | None:
        """The step wrote `blocks`: they become the checkpoint of `block_hash`'s prefix (whose
        page must be registered by now). If that prefix has one already, or its page could
        not be registered, the blocks are freed."""
        self.pending.difference_update(blocks)
        node = self.nodes.get(block_hash)
        if node is None or node.checkpoint is not None:
            self.pool.give_back(blocks)
            return None
        ckpt = Checkpoint(node, blocks, origin, hits, self.now)
        node.checkpoint = ckpt
        self.checkpoints[block_hash] = ckpt
        self._dead.pop(node, None)
        delta = 1 - node.visible_below  # seen from above, it now stands for those below it
        above = ckpt.above = self._add_visible(node, delta)
        peers = above.under if above is not None else self._tops
        if node.visible_below:  # those it stands for now resume here without their own
            moved = [c for c in peers if c.depth > node.depth and _ancestor(c.node, node.depth) is node]
            for c in moved:
                del peers[c]
                c.above = ckpt
                ckpt.under[c] = None
                self._rerank(c)
        peers[ckpt] = None
        if above is not None and above.node.visible_below - delta == 0:
            self._rerank(above)  # its pages are held for this one now (`rank`)
        self.counters.checkpoints_written += 1
        self._push(ckpt)
        return ckpt

    def _drop_checkpoint(self, ckpt: Checkpoint) -> None:
        node = ckpt.node
        del self.checkpoints[node.block_hash]
        node.checkpoint = None
        self.pool.give_back(ckpt.blocks)
        peers = ckpt.above.under if ckpt.above is not None else self._tops
        del peers[ckpt]
        for c in ckpt.under:  # they resume where it would have
            c.above = ckpt.above
            peers[c] = None
            self._rerank(c)
        ckpt.under = {}
        above = self._add_visible(node, node.visible_below - 1)  # those below it stand for themselves
        if above is not None and not above.node.visible_below:
            self._rerank(above)  # none below it any more: its pages are its own (`rank`)
        self._maybe_dead(node)

    def _rerank(self, ckpt: Checkpoint) -> None:
        """Its rank changed (what it saves, or what its eviction frees): a new place in the
        eviction order (a pinned one gets it when unpinned)."""
        if not ckpt.pins:
            self._push(ckpt)

    def _add_visible(self, node: Node, delta: int) -> Checkpoint | None:
        """Adds `delta` to the visible counts of `node`'s ancestors up to the nearest one with
        a checkpoint, which it returns (None: there is none). Those further up see that
        checkpoint and not what is below it, so a change costs the distance to it, not the
        depth of the tree (a page or two where checkpoints are dense)."""
        n = node.parent
        while n is not None:
            n.visible_below += delta
            if n.checkpoint is not None:
                return n.checkpoint
            n = n.parent
        return None

    # ------------------------------------------------------------------ eviction

    def _is_dead(self, node: Node) -> bool:
        return (
            self.recurrent
            and _unreachable(node)
            and node.children == 0
            and (not node.block or node.block not in self.pool.ref_count)
        )

    def _maybe_dead(self, node: Node) -> None:
        if not self._is_dead(node):
            return
        self._dead[node] = None
        self._dead.move_to_end(node)
        if not self.has_kv and len(self._dead) > self._max_dead_nodes:
            self._remove_node(next(iter(self._dead)))

    def _remove_node(self, node: Node) -> None:
        """Forgets a leaf page (dead, or an attention-only hit point) and frees its block."""
        self._dead.pop(node, None)
        del self.nodes[node.block_hash]
        if node.block:
            del self.node_of_block[node.block]
            self.pool.give_back([node.block])
        parent = node.parent
        if parent is None:
            return
        parent.children -= 1
        if self.recurrent:
            self._maybe_dead(parent)
        elif parent.children == 0 and parent.block not in self.pool.ref_count:
            self._push(parent)

    def _make_room(self, n: int, floor: tuple[float, int]) -> bool:
        """Evicts until `n` blocks are free, taking hit points ranked <= `floor` only."""
        while self.pool.num_free < n:
            if self.has_kv and self._dead:
                self._remove_node(next(iter(self._dead)))
                self.counters.pages_evicted += 1
                continue
            self._refresh_ranks()
            victim = self._lowest()
            if victim is not None and self._heap[0][0] <= floor:
                heapq.heappop(self._heap)
            elif floor == NO_FLOOR and self.recurrent:
                # Only checkpoints above pinned ones are left: a running sequence's need comes first.
                victim = min((c for c in self.checkpoints.values() if c.pins == 0), key=self.rank, default=None)
                if victim is None:
                    return False
            else:
                return False
            self.model.died(
                victim.node.block_hash if isinstance(victim, Checkpoint) else victim.block_hash,
                hit_class(victim.origin, victim.hits),
                self.now - victim.last_use,
                self.now,
            )
            if isinstance(victim, Checkpoint):
                self._drop_checkpoint(victim)
                self.counters.checkpoints_evicted += 1
            else:
                self._remove_node(victim)
                self.counters.pages_evicted += 1
        return True

    def trim(self, max_cached_blocks: int) -> None:
        """Evicts until cache content holds at most `max_cached_blocks` blocks."""
        excess = self.num_cached_blocks - max_cached_blocks
        if excess > 0:
            self._make_room(self.pool.num_free + excess, NO_FLOOR)

    # ------------------------------------------------------------------ accounting

    @property
    def num_page_blocks(self) -> int:
        """Cached pages no running sequence holds: all cached pages less the held ones (a pass
        over the running sequences' blocks, not over the cache)."""
        return len(self.node_of_block) - sum(1 for b in self.pool.ref_count if b in self.node_of_block)

    @property
    def num_checkpoint_blocks(self) -> int:
        return len(self.checkpoints) * self.checkpoint_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.num_page_blocks + self.num_checkpoint_blocks

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by tests)."""
        pool = self.pool
        free = pool.free_set()
        ckpt_blocks = [b for c in self.checkpoints.values() for b in c.blocks]
        node_blocks = set(self.node_of_block)
        assert len(ckpt_blocks) == len(set(ckpt_blocks)), "a block is in two checkpoints"
        groups = [free, set(ckpt_blocks), self.pending, node_blocks | set(pool.ref_count)]
        assert sum(len(g) for g in groups) == len(set().union(*groups)), "a block is counted twice"
        assert set().union(*groups) == set(range(1, pool.num_blocks)), "a block is lost or block 0 is in use"
        assert all(len(c.blocks) == self.checkpoint_blocks for c in self.checkpoints.values())
        children = collections.Counter(n.parent.block_hash for n in self.nodes.values() if n.parent is not None)
        visible = collections.Counter()
        for ckpt in self.checkpoints.values():
            assert ckpt.node.checkpoint is ckpt and ckpt.pins >= 0
            n = ckpt.node
            while n is not None:
                assert self.nodes.get(n.block_hash) is n, "a checkpoint's page is gone"
                assert not self.has_kv or n.block, "a checkpoint's page holds no block"
                n = n.parent
            n = ckpt.node.parent  # it is visible up to the nearest checkpoint above, that included
            while n is not None:
                visible[n.block_hash] += 1
                if n.checkpoint is not None:
                    break
                n = n.parent
            assert ckpt.above is (n.checkpoint if n is not None else None), "a nearest checkpoint above is off"
            assert ckpt in (ckpt.above.under if ckpt.above is not None else self._tops)
        assert len(self._tops) + sum(len(c.under) for c in self.checkpoints.values()) == len(self.checkpoints)
        for h, node in self.nodes.items():
            assert node.block_hash == h and (
                node.parent is None or self.nodes.get(node.parent.block_hash) is node.parent
            )
            assert node.children == children[h], "a child count is off"
            assert node.visible_below == visible[h], "a checkpoint count is off"
            assert (node in self._dead) == self._is_dead(node), "the dead-page list is off"
        assert all(self.nodes.get(n.block_hash) is n for n in self._dead)


def _ancestor(node: Node, depth: int) -> Node:
    """The node of `node`'s prefix that is `depth` tokens deep (`depth` <= its own)."""
    while node.depth > depth:
        node = node.parent
    return node


def _unreachable(node: Node) -> bool:
    """No checkpoint at or below the node: no hit can end at or below it."""
    return node.checkpoint is None and not node.visible_below
