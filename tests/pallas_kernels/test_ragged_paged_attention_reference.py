"""Checks the pure-jnp ragged paged attention reference against float64 numpy attention.

Each sequence's whole context gets random keys and values, scattered with `write_kv_pages`
into shuffled pages (never page 0, the null sink); the numpy reference attends each query
token, head by head, straight from those context arrays, so it never reads the pages.
Unwritten page slots and padding tokens hold large garbage that a mask error would expose.

Tolerance: the code under test takes D-term float32 dot products and a float32 softmax over
at most a few dozen positions, so its error is ~1e-6 of the magnitudes; `assert_close`
allows 1e-5 of the largest expected magnitude, far below the O(1) change of a wrong mask.
"""

import functools
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import reference
from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention,
    validate_inputs,
    write_kv_pages,
)
from tests.pallas_kernels.tolerance import assert_close_to_scale

PAGE_SIZE, KV_HEADS, HEAD_DIM = 4, 2, 8
PAGES_PER_SEQ = 11  # the longest context (37 tokens) needs 10 pages
NUM_PAD = 3  # padding tokens past the last sequence's queries
# (query tokens, context tokens) per sequence: decode with a long context, zero-length
# padded sequence, whole prefill, chunked prefill (the last 5 tokens of 21), zero-length.
MIXED_BATCH = [(1, 37), (0, 0), (9, 9), (5, 21), (0, 0)]


assert_close = functools.partial(assert_close_to_scale, tol=1e-5)  # see the module docstring


def allocate_pages(rng, kv_lens: list[int]) -> tuple[np.ndarray, int]:
    """Gives each sequence enough pages, drawn from a shuffled pool that excludes page 0
    and keeps a few spare pages nobody owns. Returns page_indices [S, PAGES_PER_SEQ]
    (unused entries point at the null page 0) and the total page count."""
    needed = [math.ceil(n / PAGE_SIZE) for n in kv_lens]
    num_pages = 1 + sum(needed) + 4
    pool = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((len(kv_lens), PAGES_PER_SEQ), np.int32)
    taken = 0
    for s, n in enumerate(needed):
        page_indices[s, :n] = pool[taken : taken + n]
        taken += n
    return page_indices, num_pages


def slot_mapping(page_indices: np.ndarray, kv_lens: list[int], num_pad: int) -> np.ndarray:
    """[sum(kv_lens) + num_pad] int32 flat slots of every context token, sequence after
    sequence; padding tokens map to slot 0 of the null page."""
    slots = [
        page_indices[s, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
        for s, n in enumerate(kv_lens)
        for pos in range(n)
    ]
    return np.asarray(slots + [0] * num_pad, np.int32)


def fill_pages(rng, kv_lens: list[int]):
    """Random contexts written into garbage-filled pages.

    Returns k_ctx and v_ctx (per sequence, [kv_len, Hkv, D] float32), page_indices
    [S, PAGES_PER_SEQ], and the written k_pages and v_pages [num_pages, PAGE_SIZE, Hkv, D].
    """
    page_indices, num_pages = allocate_pages(rng, kv_lens)
    page_shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_pages, v_pages = (rng.uniform(-100, 100, page_shape).astype(np.float32) for _ in range(2))
    k_ctx = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in kv_lens]
    v_ctx = [rng.standard_normal((n, KV_HEADS, HEAD_DIM)).astype(np.float32) for n in kv_lens]
    garbage = rng.uniform(-100, 100, (NUM_PAD, KV_HEADS, HEAD_DIM)).astype(np.float32)
    k_new = np.concatenate([*k_ctx, garbage])  # [sum(kv_lens) + NUM_PAD, Hkv, D]
    v_new = np.concatenate([*v_ctx, -garbage])
    slots = slot_mapping(page_indices, kv_lens, NUM_PAD)
    k_written, v_written = write_kv_pages(jnp.asarray(k_pages), jnp.asarray(v_pages), k_new, v_new, slots)
    return k_ctx, v_ctx, page_indices, (k_pages, v_pages), (np.asarray(k_written), np.asarray(v_written))


def numpy_attention(q, k_ctx, v_ctx, sm_scale, sliding_window, soft_cap):
    """Float64 causal attention of a sequence's queries, token by token and head by head.

    q [q_len, Hq, D] are the last q_len of the kv_len context positions; k_ctx and v_ctx
    [kv_len, Hkv, D]; query head h reads KV head h // (Hq / Hkv). A sliding window of w keeps
    the w most recent positions, the query's own included. -> [q_len, Hq, D]
    """
    q_len, q_heads, _ = q.shape
    group = q_heads // KV_HEADS
    k_ctx, v_ctx = k_ctx.astype(np.float64), v_ctx.astype(np.float64)
    out = np.zeros(q.shape)
    for i in range(q_len):
        pos = len(k_ctx) - q_len + i
        first = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        for h in range(q_heads):
            keys, values = k_ctx[first : pos + 1, h // group], v_ctx[first : pos + 1, h // group]
            scores = keys @ q[i, h].astype(np.float64) * sm_scale  # [context]
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            probs = np.exp(scores - scores.max())
            out[i, h] = probs @ values / probs.sum()
    return out


def test_write_kv_pages_places_each_token():
    """Token at position pos of sequence s lands in page page_indices[s, pos // page_size],
    offset pos % page_size; slots outside every context, page 0 aside, are untouched."""
    kv_lens = [n for _, n in MIXED_BATCH]
    k_ctx, v_ctx, page_indices, before, after = fill_pages(np.random.default_rng(0), kv_lens)
    assert np.any(np.diff(page_indices[0, :10]) != 1)  # the decode sequence's pages are scattered
    untouched = np.ones(before[0].shape[:2], bool)  # [num_pages, PAGE_SIZE]
    untouched[0] = False  # padding tokens write the null page
    for s, n in enumerate(kv_lens):
        for pos in range(n):
            page, offset = page_indices[s, pos // PAGE_SIZE], pos % PAGE_SIZE
            np.testing.assert_array_equal(after[0][page, offset], k_ctx[s][pos])
            np.testing.assert_array_equal(after[1][page, offset], v_ctx[s][pos])
            untouched[page, offset] = False
    for old, new in zip(before, after):
        np.testing.assert_array_equal(new[untouched], old[untouched])


@pytest.mark.parametrize("per_sequence", [None, True, False], ids=["auto", "per-sequence", "per-token"])
@pytest.mark.parametrize("soft_cap", [None, 1.5])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_numpy(group, sliding_window, soft_cap, per_sequence):
    """Decode, prefill, chunked prefill, zero-length sequences and padding tokens at once,
    with either context layout (the whole context in one chunk of `KV_CHUNK` positions)."""
    check_mixed_batch(group, sliding_window, soft_cap, per_sequence)


@pytest.mark.parametrize("per_sequence", [True, False], ids=["per-sequence", "per-token"])
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("kv_chunk", [4, 8, 12])  # one, two (the window skips chunks) or three pages
def test_context_read_in_chunks_matches_numpy(monkeypatch, kv_chunk, sliding_window, per_sequence):
    """The context in several chunks (the online softmax across them, chunks skipped before
    the window and after the last query), against the same float64 attention."""
    monkeypatch.setattr(reference, "KV_CHUNK", kv_chunk)
    check_mixed_batch(2, sliding_window, 1.5, per_sequence)


def check_mixed_batch(group: int, sliding_window: int | None, soft_cap: float | None, per_sequence: bool | None):
    rng = np.random.default_rng(group + 10 * (sliding_window is None) + 100 * (soft_cap is None))
    q_lens, kv_lens = [q for q, _ in MIXED_BATCH], [n for _, n in MIXED_BATCH]
    k_ctx, v_ctx, page_indices, _, (k_pages, v_pages) = fill_pages(rng, kv_lens)
    num_valid, q_heads = sum(q_lens), KV_HEADS * group
    q = rng.standard_normal((num_valid + NUM_PAD, q_heads, HEAD_DIM)).astype(np.float32)  # [T, Hq, D]
    q[num_valid:] = rng.uniform(-100, 100, (NUM_PAD, q_heads, HEAD_DIM))
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    sm_scale = HEAD_DIM**-0.5

    out = ragged_paged_attention(
        q,
        k_pages,
        v_pages,
        np.asarray(kv_lens, np.int32),
        page_indices,
        cu_q_lens,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        per_sequence=per_sequence,
    )
    want = np.zeros(q.shape)
    for s in range(len(MIXED_BATCH)):
        tokens = slice(cu_q_lens[s], cu_q_lens[s + 1])
        want[tokens] = numpy_attention(q[tokens], k_ctx[s], v_ctx[s], sm_scale, sliding_window, soft_cap)
    assert_close(out, want)
    np.testing.assert_array_equal(np.asarray(out)[num_valid:], 0.0)  # padding tokens


def valid_arrays() -> dict:
    """Well-formed inputs of `validate_inputs` for 2 sequences and 5 tokens (values irrelevant)."""
    return {
        "q": np.zeros((5, 4, HEAD_DIM), np.float32),
        "k_pages": np.zeros((6, PAGE_SIZE, KV_HEADS, HEAD_DIM), np.float32),
        "v_pages": np.zeros((6, PAGE_SIZE, KV_HEADS, HEAD_DIM), np.float32),
        "kv_lens": np.zeros(2, np.int32),
        "page_indices": np.zeros((2, 3), np.int32),
        "cu_q_lens": np.zeros(3, np.int32),
    }


BAD_INPUTS = {  # case -> (argument replaced, its bad value, pattern the error must match)
    "q_rank": ("q", np.zeros((5, 4 * HEAD_DIM), np.float32), r"\bq\b"),
    "q_heads_not_multiple": ("q", np.zeros((5, 3, HEAD_DIM), np.float32), "q_heads"),
    "head_dim_differs": ("q", np.zeros((5, 4, HEAD_DIM // 2), np.float32), "head_dim of q"),
    "k_pages_rank": ("k_pages", np.zeros((6 * PAGE_SIZE, KV_HEADS, HEAD_DIM), np.float32), "k_pages"),
    "v_pages_shape": ("v_pages", np.zeros((7, PAGE_SIZE, KV_HEADS, HEAD_DIM), np.float32), "v_pages"),
    "page_indices_seqs": ("page_indices", np.zeros((3, 3), np.int32), "page_indices"),
    "page_indices_rank": ("page_indices", np.zeros(6, np.int32), "page_indices"),
    "cu_q_lens_length": ("cu_q_lens", np.zeros(2, np.int32), "cu_q_lens"),
    "kv_lens_dtype": ("kv_lens", np.zeros(2, np.float32), "kv_lens"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_validate_inputs_names_bad_argument(case):
    """Each malformed argument raises ValueError with a message naming it."""
    name, bad, pattern = BAD_INPUTS[case]
    validate_inputs(**valid_arrays())
    with pytest.raises(ValueError, match=pattern):
        validate_inputs(**{**valid_arrays(), name: bad})


def test_attention_validates_its_inputs():
    """ragged_paged_attention runs the same checks before computing anything."""
    with pytest.raises(ValueError, match="cu_q_lens"):
        ragged_paged_attention(**{**valid_arrays(), "cu_q_lens": np.zeros(2, np.int32)}, sm_scale=1.0)
