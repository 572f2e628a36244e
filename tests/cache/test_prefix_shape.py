"""The shape of recently seen prefixes: where a request leaves them, where they branch."""

from jaxengine.cache.block_hash import extend_hashes, root_hash
from jaxengine.cache.prefix_shape import PrefixShape


def _pages(tokens: list[int]) -> list[bytes]:
    return extend_hashes([], tokens, 2, root_hash(None))


def _add(shape: PrefixShape, tokens: list[int]) -> None:
    """A request's admission (a walk) and its computed pages."""
    hashes = _pages(tokens)
    shape.walk(hashes)
    for i, h in enumerate(hashes):
        shape.add(h, hashes[i - 1] if i else None)


def test_a_walk_finds_where_a_request_leaves_and_where_paths_branch():
    shape = PrefixShape(max_pages=100)
    _add(shape, [1, 1, 2, 2, 3, 3, 4, 4])  # pages A B C D
    _add(shape, [1, 1, 2, 2, 5, 5])  # A B E: paths branch after B (2 pages)
    walk = shape.walk(_pages([1, 1, 2, 2, 3, 3, 6, 6, 7, 7]))  # A B C, then new pages
    assert walk.seen == 3
    # After B: passed by both earlier requests and this one; after C: by the first and this one.
    assert walk.branches == [(2, 3), (3, 2)]
    assert shape.walk(_pages([1, 1, 2, 2, 5, 5])).branches == [(2, 4)]  # ends on a seen path


def test_pages_are_forgotten_least_recently_seen_first():
    shape = PrefixShape(max_pages=4)
    _add(shape, [1, 1, 2, 2, 3, 3])
    _add(shape, [9, 9, 8, 8])  # 5 pages: the oldest, the first one's root, goes
    assert len(shape) == 4 and shape.walk(_pages([1, 1, 2, 2, 3, 3, 4, 4])).seen == 0
    extended = shape.walk(_pages([9, 9, 8, 8, 7, 7]))  # goes on where the seen path ended
    assert extended.seen == 2 and extended.branches == []  # a next turn parts from nothing
    assert shape.walk(_pages([9, 9, 8, 8])).branches == []  # ends on a seen path: parts nowhere
