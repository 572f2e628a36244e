"""Checks the pure-jnp selective-scan (Mamba-1) reference against a float64 numpy recurrence
run one token at a time.

Tolerance: the code under test computes in float32 (eps ~1.2e-7): per token one decay and
one write per state entry, chained over at most a few dozen tokens, and a sum over the N
state entries per output; its rounding error stays around 1e-6 of the magnitudes involved.
`assert_close` allows 1e-4 of the largest expected magnitude, while a real mistake (a
missing decay, a dropped token, a state not carried across rows, B and C swapped) moves
values by O(1) of their magnitude. bfloat16 inputs are compared with the recurrence of the
same bfloat16 values: the reference computes in float32 whatever its inputs.
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from pallas_kernels.selective_scan import ragged_selective_scan, selective_state_update, selective_states_at
from tests.pallas_kernels.scan_checks import assert_scan_states, every_position, states_after
from tests.pallas_kernels.tolerance import assert_close_to_scale
from tests.property_examples import examples

CHANNELS, STATE = 6, 4
# Every drawn batch is padded to these sizes, so the jitted functions compile once per chunk
# size and dtype rather than once per example.
NUM_TOKENS, NUM_SEQS = 80, 4

scan = jax.jit(ragged_selective_scan, static_argnames=("chunk_size",))
states_at = jax.jit(selective_states_at, static_argnames=("window",))

assert_close = functools.partial(assert_close_to_scale, tol=1e-4)  # see the module docstring


def make_inputs(rng, lengths, start_pos, num_pad: int, dtype, channels: int = CHANNELS, state: int = STATE) -> dict:
    """Random inputs of `ragged_selective_scan`, rounded to `dtype`. Decays exp(dt A) lie in
    about [0.2, 0.99] per token; the `num_pad` padding tokens hold large garbage (dt too)."""
    num_valid = int(sum(lengths))
    num_tokens = num_valid + num_pad
    inputs = {
        "x": rng.standard_normal((num_tokens, channels)),
        "dt": rng.uniform(0.05, 0.8, (num_tokens, channels)),
        "B": rng.standard_normal((num_tokens, state)),
        "C": rng.standard_normal((num_tokens, state)),
    }
    for name in inputs:
        inputs[name][num_valid:] = rng.uniform(-1e3, 1e3, inputs[name][num_valid:].shape)
    inputs["A"] = -rng.uniform(0.2, 2.0, (channels, state))
    inputs["init_states"] = rng.standard_normal((len(lengths), channels, state))
    inputs = {name: jnp.asarray(value, dtype) for name, value in inputs.items()}
    inputs["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs["start_pos"] = np.asarray(start_pos, np.int32)
    return inputs


def recurrence(inputs: dict) -> tuple[np.ndarray, list[list[np.ndarray]]]:
    """float64, one token at a time: outputs [T, d] (zero for padding) and, per sequence, its
    state after each of its tokens."""
    f64 = {name: np.asarray(value, np.float64) for name, value in inputs.items()}
    out = np.zeros(f64["x"].shape)
    states = []
    cu = inputs["cu_seqlens"]
    for s in range(len(cu) - 1):
        state, after = f64["init_states"][s].copy(), []
        for t in range(cu[s], cu[s + 1]):
            dt = f64["dt"][t][:, None]  # [d, 1]
            state = np.exp(dt * f64["A"]) * state + dt * f64["x"][t][:, None] * f64["B"][t][None, :]
            out[t] = state @ f64["C"][t]
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
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    return chunk, lengths, starts, dtype, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=examples(40), deadline=None)
@given(batches())
def test_scan_matches_float64_recurrence(batch):
    chunk, lengths, starts, dtype, seed = batch
    inputs = make_inputs(np.random.default_rng(seed), lengths, starts, NUM_TOKENS - sum(lengths), dtype)
    got = scan(**inputs, chunk_size=chunk)
    want_out, want_states = recurrence(inputs)
    assert got.y.dtype == jnp.float32
    assert_close(got.y, want_out)
    assert_scan_states(got, want_states, inputs["init_states"], lengths, starts, chunk, assert_close)
    seq, pos, count = every_position(lengths, starts, NUM_TOKENS)
    at = states_at(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
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
@given(st.integers(0, 2**31 - 1))
def test_one_token_update_matches_recurrence(seed):
    inputs = make_inputs(np.random.default_rng(seed), [1] * NUM_SEQS, [0] * NUM_SEQS, 0, jnp.float32)
    y, state = jax.jit(selective_state_update)(
        inputs["init_states"], inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"]
    )
    want_out, want_states = recurrence(inputs)
    assert_close(y, want_out)
    assert_close(state, np.stack([after[0] for after in want_states]))


def test_rows_follow_absolute_chunks():
    """A sequence resuming mid-chunk gets a short first row, so its row ends are the chunk
    boundaries whichever step computed them; a zero-length sequence keeps its state."""
    inputs = make_inputs(np.random.default_rng(0), [10, 0], [5, 3], 2, jnp.float32)
    got = ragged_selective_scan(**inputs, chunk_size=4)
    ends = [int(e) for s, e in zip(got.chunk_seq, got.chunk_end) if int(s) == 0]
    assert ends == [8, 12, 15]
    np.testing.assert_array_equal(got.final_states[1], inputs["init_states"][1])
