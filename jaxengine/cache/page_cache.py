"""KV pages shared by prefix: a free list, a hash registry, reference counts and LRU eviction."""

import collections


class PageCache:
    """Hands out KV pages and keeps full ones reusable under their block hash.

    A page is *free* (on the free list), *referenced* (held by running sequences; a count per
    holder) or *cached* (unreferenced but registered under a hash, kept until space is
    needed, evicted least recently used first). Page 0 is the null sink, never handed out."""

    def __init__(self, num_pages: int, *, enabled: bool = True):
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (page 0 is the null sink), got {num_pages}")
        self.num_pages = num_pages
        self.enabled = enabled
        self._free = list(range(num_pages - 1, 0, -1))
        self.ref_count: dict[int, int] = {}
        self.page_of_hash: dict[bytes, int] = {}
        self.hash_of_page: dict[int, bytes] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unreferenced
        self.evictions = 0

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages that can be handed out now: free plus evictable."""
        return len(self._free) + len(self._lru)

    @property
    def num_in_use(self) -> int:
        return len(self.ref_count)

    @property
    def num_cached(self) -> int:
        return len(self.hash_of_page)

    def allocate(self, n: int) -> list[int] | None:
        """`n` private pages (referenced once), evicting cached ones if needed; None if impossible."""
        if n > self.num_free:
            return None
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._lru.popitem(last=False)
                del self.page_of_hash[self.hash_of_page.pop(page)]
                self.evictions += 1
            self.ref_count[page] = 1
            pages.append(page)
        return pages

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest prefix of `hashes`, without taking them."""
        if not self.enabled:
            return []
        pages = []
        for h in hashes:
            page = self.page_of_hash.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: list[int]) -> None:
        """Takes one more reference on cached or referenced pages (a prefix hit)."""
        for page in pages:
            if page in self._lru:
                del self._lru[page]
            self.ref_count[page] = self.ref_count.get(page, 0) + 1

    def release(self, pages: list[int]) -> None:
        """Drops one reference per page; unreferenced pages become cached (if hashed) or free."""
        for page in pages:
            count = self.ref_count.get(page)
            if count is None:
                raise RuntimeError(f"KV page {page} released but not referenced")
            if count > 1:
                self.ref_count[page] = count - 1
                continue
            del self.ref_count[page]
            if page in self.hash_of_page:
                self._lru[page] = None
            else:
                self._free.append(page)

    def register(self, page: int, block_hash: bytes) -> None:
        """Records that a referenced `page` now holds exactly the tokens `block_hash` names.
        If another page already holds them, this one stays private."""
        if not self.enabled or page in self.hash_of_page or block_hash in self.page_of_hash:
            return
        self.page_of_hash[block_hash] = page
        self.hash_of_page[page] = block_hash

    def check_invariants(self) -> None:
        """Raises AssertionError if the bookkeeping is inconsistent (used by tests)."""
        free = set(self._free)
        lru = set(self._lru)
        referenced = set(self.ref_count)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert not (free & lru) and not (free & referenced) and not (lru & referenced)
        assert free | lru | referenced == set(range(1, self.num_pages)), "a page is lost or page 0 is in use"
        assert all(c > 0 for c in self.ref_count.values())
        assert lru <= set(self.hash_of_page)
        assert all(self.page_of_hash[h] == p for p, h in self.hash_of_page.items())
        assert len(self.page_of_hash) == len(self.hash_of_page)
