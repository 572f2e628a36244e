"""Checks the pure-jnp gated-delta-rule reference against a float64 numpy recurrence run one
token at a time.

Tolerance: the code under test computes in float32 (eps ~1.2e-7): per row a unit lower
triangular solve of at most chunk_size unknowns, whose entries are products of unit-norm
keys, learning rates below 1 and decays below 1, then a few matrix products; its rounding
error stays around 1e-6 of the magnitudes involved. `assert_close` allows 1e-4 of the
largest expected magnitude, while a real mistake (a missing decay, a dropped token, a wrong
key head, a state not carried across rows) moves values by O(1) of their magnitude.
bfloat16 inputs are compared with the recurrence of the same bfloat16 values: the reference
computes in float32 whatever its inputs, so the tolerance is the same.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from pallas_kernels.gated_delta import gated_delta_states_at, gated_delta_update, ragged_gated_delta
from tests.pallas_kernels.scan_checks import assert_scan_states, every_position, states_after
from tests.pallas_kernels.tolerance import assert_close_to_scale
from tests.property_examples import examples

KEY_DIM, VALUE_DIM = 8, 6
# Every drawn batch is padded to these sizes, so the jitted functions compile once per chunk
# size, head layout and dtype rather than once per example.
NUM_TOKENS, NUM_SEQS = 80, 4

scan = jax.jit(ragged_gated_delta, static_argnames=("chunk_size", "scale"))
states_at = jax.jit(gated_delta_states_at, static_argnames=("window",))

assert_close = functools.partial(assert_close_to_scale, tol=1e-4)  # see the module docstring


def l2_normalised(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def make_inputs(rng, lengths, start_pos, key_heads: int, ratio: int, num_pad: int, dtype) -> dict:
    """Random inputs of `ragged_gated_delta`, rounded to `dtype`. Decays exp(g) lie in about
    [0.6, 0.99] per token and learning rates in [0.1, 0.9]; the `num_pad` padding tokens hold
    large garbage (g and beta too)."""
    num_valid = int(sum(lengths))
    num_tokens = num_valid + num_pad
    heads = key_heads * ratio
    inputs = {
        "q": l2_normalised(rng.standard_normal((num_tokens, key_heads, KEY_DIM))),
        "k": l2_normalised(rng.standard_normal((num_tokens, key_heads, KEY_DIM))),
        "v": rng.standard_normal((num_tokens, heads, VALUE_DIM)),
        "g": -rng.uniform(0.01, 0.5, (num_tokens, heads)),
        "beta": rng.uniform(0.1, 0.9, (num_tokens, heads)),
        "init_states": rng.standard_normal((len(lengths), heads, KEY_DIM, VALUE_DIM)),
    }
    for name in inputs:
        if name != "init_states":
            inputs[name][num_valid:] = rng.uniform(-1e3, 1e3, inputs[name][num_valid:].shape)
    inputs = {name: jnp.asarray(value, dtype) for name, value in inputs.items()}
    inputs["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs["start_pos"] = np.asarray(start_pos, np.int32)
    return inputs


def recurrence(inputs: dict, scale: float) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """float64, one token at a time: outputs [T, H_v, d_v] (zero for padding) and, per
    sequence, its state after each of its tokens."""
    f64 = {name: np.asarray(value, np.float64) for name, value in inputs.items()}
    heads = f64["v"].shape[1]
    ratio = heads // f64["k"].shape[1]
    out = np.zeros(f64["v"].shape)
    states = []
    cu = inputs["cu_seqlens"]
    for s in range(len(cu) - 1):
        state, after = f64["init_states"][s].copy(), []
        for t in range(cu[s], cu[s + 1]):
            q, k = np.repeat(f64["q"][t], ratio, 0) * scale, np.repeat(f64["k"][t], ratio, 0)  # [H, d_k]
            state = np.exp(f64["g"][t])[:, None, None] * state
            delta = (f64["v"][t] - np.einsum("hdv,hd->hv", state, k)) * f64["beta"][t][:, None]
            state = state + k[:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hdv,hd->hv", state, q)
            after.append(state.copy())
        states.append(after)
    return out, states


@st.composite
def batches(draw):
    chunk = draw(st.sampled_from([4, 8]))
    # Segment lengths of 0, 1, and on either side of chunk edges; starts at and inside chunks.
    length = st.sampled_from([0, 1, 2, chunk - 1, chunk, chunk + 1, 2 * chunk + 3])
    lengths = draw(st.lists(length, min_size=NUM_SEQS, max_size=NUM_SEQS))
    starts = [draw(st.sampled_from([0, 1, chunk - 1, chunk, 2 * chunk + 1])) for _ in lengths]
    key_heads, ratio = draw(st.sampled_from([(1, 1), (2, 1), (1, 3), (2, 2)]))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    return chunk, lengths, starts, key_heads, ratio, dtype, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=examples(40), deadline=None)
@given(batches())
def test_scan_matches_float64_recurrence(batch):
    chunk, lengths, starts, key_heads, ratio, dtype, seed = batch
    num_pad = NUM_TOKENS - sum(lengths)
    inputs = make_inputs(np.random.default_rng(seed), lengths, starts, key_heads, ratio, num_pad, dtype)
    scale = KEY_DIM**-0.5
    got = scan(**inputs, chunk_size=chunk, scale=scale)
    want_out, want_states = recurrence(inputs, scale)
    assert got.o.dtype == jnp.float32
    assert_close(got.o, want_out)
    assert_scan_states(got, want_states, inputs["init_states"], lengths, starts, chunk, assert_close)
    seq, pos, count = every_position(lengths, starts, NUM_TOKENS)
    at = states_at(
        inputs["k"],
        inputs["v"],
        inputs["g"],
        inputs["beta"],
        inputs["init_states"],
        inputs["cu_seqlens"],
        inputs["start_pos"],
        got,
        seq,
        pos,
        window=chunk,
    )
    if count:
        assert_close(at[:count], states_after(want_states, seq, pos, starts, count))


@settings(max_examples=examples(10), deadline=None)
@given(st.sampled_from([(1, 1), (2, 2), (1, 3)]), st.integers(0, 2**31 - 1))
def test_one_token_update_matches_recurrence(heads, seed):
    key_heads, ratio = heads
    lengths = [1] * NUM_SEQS
    inputs = make_inputs(np.random.default_rng(seed), lengths, [0] * NUM_SEQS, key_heads, ratio, 0, jnp.float32)
    scale = KEY_DIM**-0.5
    out, state = jax.jit(gated_delta_update, static_argnames="scale")(
        inputs["init_states"], inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], scale=scale
    )
    want_out, want_states = recurrence(inputs, scale)
    assert_close(out, want_out)
    assert_close(state, np.stack([after[0] for after in want_states]))


def test_rows_follow_absolute_chunks():
    """A sequence resuming mid-chunk gets a short first row, so its row ends are the chunk
    boundaries whichever step computed them; a zero-length sequence keeps its state."""
    inputs = make_inputs(np.random.default_rng(0), [10, 0], [5, 3], 1, 2, 2, jnp.float32)
    got = ragged_gated_delta(**inputs, chunk_size=4, scale=1.0)
    ends = [int(e) for s, e in zip(got.chunk_seq, got.chunk_end) if int(s) == 0]
    assert ends == [8, 12, 15]
    np.testing.assert_array_equal(got.final_states[1], inputs["init_states"][1])
