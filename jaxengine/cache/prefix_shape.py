"""The shape of recently seen prefixes: which pages followed which, kept after their KV is gone.

The cache's own tree forgets a path when its pages are evicted, and with it the knowledge of
where a new request leaves that path. That knowledge is cheap to keep (a hash and a count per
page, no device memory) and it is what places checkpoints where later hits end, and says
what they are worth:

  * *junctions*: where a request leaves the paths earlier requests took, and where those
    paths themselves branch, even if their pages were evicted. A request stores the state at
    each of them that it computes, so the next request that parts there hits, and the
    checkpoint starts with as many uses as requests have passed that page;
  * the *divergence grain* (`divergence_grain.py`): the depths where requests leave paths say
    whether prefixes part anywhere or only at multiples of some block.

Chained hashes name whole prefixes (`block_hash.py`), so the pages seen form a tree; each is
kept with the number of different pages seen to follow it and of lookups that passed it. Pages are remembered least
recently seen first out, up to `max_pages`; a lookup refreshes the path it walks, root first,
so an unused path is forgotten from its root.
"""

import collections
import dataclasses


@dataclasses.dataclass
class Walk:
    """What the shape knows of a request's pages."""

    seen: int  # leading pages an earlier request computed
    # (depth in pages, requests that passed it, this one included) where the paths seen go
    # different ways, and where this request leaves a path that went on (not one that ended
    # there: a request that extends it parts from nothing)
    branches: list[tuple[int, int]]


@dataclasses.dataclass(slots=True)
class _Page:
    children: int = 0  # different pages seen to follow it
    visits: int = 1  # requests whose pages included it


class PrefixShape:
    """Page hash -> how many different pages were seen to follow it, and visits."""

    def __init__(self, max_pages: int):
        self.max_pages = max_pages
        self.pages: collections.OrderedDict[bytes, _Page] = collections.OrderedDict()

    def add(self, block_hash: bytes, parent_hash: bytes | None) -> None:
        """A page named `block_hash`, following `parent_hash` (None: the first page), was computed."""
        if block_hash in self.pages:
            self.pages.move_to_end(block_hash)
            return
        parent = self.pages.get(parent_hash) if parent_hash is not None else None
        if parent is not None:
            parent.children += 1
        self.pages[block_hash] = _Page()
        if len(self.pages) > self.max_pages:
            self.pages.popitem(last=False)

    def walk(self, hashes: list[bytes]) -> Walk:
        """The leading pages of `hashes` seen before, and where the seen paths part on them.
        Counts the walk as a visit of each page it passes."""
        branches = []
        for depth, h in enumerate(hashes, 1):
            page = self.pages.get(h)
            if page is None:
                last = self.pages.get(hashes[depth - 2]) if depth > 1 else None
                if last is not None and last.children == 1:  # the seen path went on otherwise: it parts here
                    branches.append((depth - 1, last.visits))
                return Walk(depth - 1, branches)
            self.pages.move_to_end(h)
            page.visits += 1
            if page.children > 1:
                branches.append((depth, page.visits))
        return Walk(len(hashes), branches)

    def __len__(self) -> int:
        return len(self.pages)
