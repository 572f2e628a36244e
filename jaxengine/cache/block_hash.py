"""Chained hashes of full KV pages, stable across processes.

The hash of page i covers the hash of page i - 1 and page i's tokens, so one hash names a
whole prefix. A request's `cache_salt` seeds the chain: requests with different salts share
nothing. Python's `hash` is salted per process, so SHA-256 is used instead.
"""

import functools
import hashlib
from collections.abc import Sequence

import numpy as np

HASH_BYTES = 16


@functools.lru_cache(maxsize=1024)
def root_hash(cache_salt: str | None) -> bytes:
    """The chain's starting value for a cache namespace."""
    return hashlib.sha256(b"jaxengine-prefix/" + (cache_salt or "").encode()).digest()[:HASH_BYTES]


def extend_hashes(hashes: list[bytes], tokens: Sequence[int], page_size: int, root: bytes) -> list[bytes]:
    """Appends to `hashes` the hashes of every full page of `tokens` not hashed yet; returns it."""
    for i in range(len(hashes), len(tokens) // page_size):
        parent = hashes[i - 1] if i else root
        page = np.asarray(tokens[i * page_size : (i + 1) * page_size], dtype=np.int64).tobytes()
        hashes.append(hashlib.sha256(parent + page).digest()[:HASH_BYTES])
    return hashes
