"""Checks the pure-jnp SSD reference against a float64 numpy recurrence run one token at a time.

Tolerance: the code under test computes in float32 (eps ~1.2e-7). Each value it returns is a
sum of at most chunk_size * N products within a row plus a decayed carried state, and its
decays are exponentials of float32 cumulative sums, so its rounding error stays around 1e-6
of the magnitudes involved. `assert_close` allows 1e-4 of the largest expected magnitude:
a real mistake (a missing decay, a dropped token, a wrong group) moves values by O(1) of
their magnitude, far above that.
"""

import functools

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels.ragged import num_scan_rows
from pallas_kernels.ssd.reference import ragged_ssd_scan, ssd_state_update, ssd_states_at
from tests.pallas_kernels.tolerance import assert_close_to_scale
from tests.property_examples import examples

NUM_HEADS, HEAD_DIM, STATE_SIZE = 4, 3, 5  # H, P, N


assert_close = functools.partial(assert_close_to_scale, tol=1e-4)  # see the module docstring


def cu_from_lengths(lengths: list[int]) -> np.ndarray:
    """[S] lengths -> [S + 1] int32 offsets."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_inputs(rng, lengths, start_pos, num_groups: int, num_pad: int, pad_fill: str = "garbage") -> dict:
    """Random ragged-scan inputs, keyed by the argument names of `ragged_ssd_scan`.

    Decays exp(dt * A) lie in about [0.64, 0.97] per token, so initial states stay visible
    over a few chunks. The `num_pad` padding tokens past the last sequence hold large finite
    garbage (dt too) when `pad_fill == "garbage"`, zeros when `pad_fill == "zeros"`.
    """
    num_valid = int(sum(lengths))
    num_tokens = num_valid + num_pad
    f32 = np.float32
    inputs = {
        "x": rng.standard_normal((num_tokens, NUM_HEADS, HEAD_DIM)).astype(f32),  # [T, H, P]
        "dt": rng.uniform(0.05, 0.3, (num_tokens, NUM_HEADS)).astype(f32),  # [T, H]
        "A": -rng.uniform(0.1, 1.5, NUM_HEADS).astype(f32),  # [H]
        "B": rng.standard_normal((num_tokens, num_groups, STATE_SIZE)).astype(f32),  # [T, G, N]
        "C": rng.standard_normal((num_tokens, num_groups, STATE_SIZE)).astype(f32),  # [T, G, N]
        "init_states": rng.standard_normal((len(lengths), NUM_HEADS, HEAD_DIM, STATE_SIZE)).astype(f32),
        "cu_seqlens": cu_from_lengths(lengths),  # [S + 1]
        "start_pos": np.asarray(start_pos, np.int32),  # [S]
    }
    for name in ("x", "B", "C"):
        pad = inputs[name][num_valid:]
        pad[...] = rng.uniform(-1e3, 1e3, pad.shape) if pad_fill == "garbage" else 0.0
    inputs["dt"][num_valid:] = rng.uniform(1.0, 10.0, (num_pad, NUM_HEADS)) if pad_fill == "garbage" else 0.0
    return inputs


def recurrence_step(state, x, dt, A, B, C):
    """One token of the SSD recurrence in float64, head by head.

    state [H, P, N], x [H, P], dt [H], A [H], B and C [G, N] -> (y [H, P], new state [H, P, N]).
    """
    heads_per_group = NUM_HEADS // B.shape[0]
    new_state = np.empty_like(state)
    y = np.empty((NUM_HEADS, HEAD_DIM))
    for h in range(NUM_HEADS):
        g = h // heads_per_group
        new_state[h] = np.exp(dt[h] * A[h]) * state[h] + dt[h] * np.outer(x[h], B[g])
        y[h] = new_state[h] @ C[g]
    return y, new_state


def sequential_scan(inputs: dict):
    """Runs every sequence token by token in float64.

    Returns y [T, H, P] (zero for padding), final states [S, H, P, N] and, per sequence, the
    list of its states after each of its tokens: entry i has absorbed the token at absolute
    position start + i, so it is the state at (exclusive) end position start + i + 1.
    """
    arr = {k: np.asarray(v, np.float64) for k, v in inputs.items() if k not in ("cu_seqlens", "start_pos")}
    cu = inputs["cu_seqlens"]
    y = np.zeros(arr["x"].shape)
    final_states = arr["init_states"].copy()
    trajectories = []
    for s in range(len(cu) - 1):
        state = arr["init_states"][s]
        trajectory = []
        for t in range(cu[s], cu[s + 1]):
            y[t], state = recurrence_step(state, arr["x"][t], arr["dt"][t], arr["A"], arr["B"][t], arr["C"][t])
            trajectory.append(state)
        final_states[s] = state
        trajectories.append(trajectory)
    return y, final_states, trajectories


def expected_chunk_ends(start: int, length: int, chunk_size: int) -> list[int]:
    """Absolute end positions of the chunks a sequence spans this step, in order: every
    multiple of chunk_size strictly inside (start, start + length), then start + length."""
    if length == 0:
        return []
    end = start + length
    return list(range((start // chunk_size + 1) * chunk_size, end, chunk_size)) + [end]


def check_against_sequential(inputs: dict, chunk_size: int) -> None:
    """Runs the reference scan and checks all its outputs against `sequential_scan`."""
    out = ragged_ssd_scan(**inputs, chunk_size=chunk_size)
    want_y, want_final, trajectories = sequential_scan(inputs)
    cu, start_pos = inputs["cu_seqlens"], inputs["start_pos"]
    num_seqs, num_valid = len(start_pos), int(cu[-1])

    assert_close(out.y, want_y)
    np.testing.assert_array_equal(np.asarray(out.y)[num_valid:], 0.0)  # padding tokens
    assert_close(out.final_states, want_final)  # empty sequences keep their initial state

    chunk_seq, chunk_end = np.asarray(out.chunk_seq), np.asarray(out.chunk_end)
    num_rows = num_scan_rows(len(inputs["x"]), num_seqs, chunk_size)
    assert out.chunk_states.shape == (num_rows, NUM_HEADS, HEAD_DIM, STATE_SIZE)
    assert np.all((chunk_seq >= 0) & (chunk_seq <= num_seqs))  # S marks unused rows
    for s in range(num_seqs):
        rows = np.flatnonzero(chunk_seq == s)
        length = int(cu[s + 1] - cu[s])
        assert chunk_end[rows].tolist() == expected_chunk_ends(int(start_pos[s]), length, chunk_size), f"seq {s}"
        for r in rows:
            assert_close(out.chunk_states[r], trajectories[s][chunk_end[r] - start_pos[s] - 1])


# Chunk size 8. Sequence by sequence: empty first; mid-chunk start ending on a boundary;
# empty mid-batch; one token one before a boundary; shorter than a chunk, starting on a
# boundary; exactly one chunk from 0; mid-chunk start spanning four chunks; one before a
# boundary spanning three chunks; last, empty and followed by 5 padding tokens.
MIXED_LENGTHS = [0, 5, 0, 1, 3, 8, 20, 10, 0]
MIXED_STARTS = [4, 3, 6, 7, 16, 0, 13, 7, 9]
MIXED_PAD = 5
# The same batch without padding: the last sequence takes the padding's 5 tokens, keeping
# the shapes (and so the compiled ops) of the padded batch.
UNPADDED_LENGTHS = MIXED_LENGTHS[:-1] + [MIXED_PAD]


@pytest.mark.parametrize(
    ("lengths", "num_pad", "num_groups"),
    [
        (MIXED_LENGTHS, MIXED_PAD, 1),
        (MIXED_LENGTHS, MIXED_PAD, 2),
        (MIXED_LENGTHS, MIXED_PAD, 4),
        (UNPADDED_LENGTHS, 0, 2),
    ],
    ids=["padded-G1", "padded-G2", "padded-G4", "unpadded-G2"],
)
def test_mixed_batch_matches_sequential(lengths, num_pad, num_groups):
    """Every length / start-position case in one ragged batch, with or without padding garbage."""
    inputs = make_inputs(np.random.default_rng(num_groups), lengths, MIXED_STARTS, num_groups, num_pad)
    check_against_sequential(inputs, chunk_size=8)


def test_padding_values_do_not_leak():
    """Garbage and zeros in the padding tokens give bit-identical outputs."""
    garbage = make_inputs(np.random.default_rng(0), MIXED_LENGTHS, MIXED_STARTS, 2, MIXED_PAD)
    zeros = make_inputs(np.random.default_rng(0), MIXED_LENGTHS, MIXED_STARTS, 2, MIXED_PAD, pad_fill="zeros")
    for got, want in zip(ragged_ssd_scan(**garbage, chunk_size=8), ragged_ssd_scan(**zeros, chunk_size=8)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


HYPOTHESIS_SEQS = 4


def hypothesis_tokens(chunk_size: int) -> int:
    """Token count of the drawn batches: fixed per chunk size so the shapes, and hence the
    op-by-op compilations, repeat across examples; always leaves at least one padding token."""
    return HYPOTHESIS_SEQS * 3 * chunk_size + 1


@st.composite
def ragged_cases(draw):
    """(lengths, start positions, chunk size, groups, seed): four sequences of 0 to three
    chunks each; starts favour chunk boundaries and the tokens just after and just before one."""
    chunk_size = draw(st.sampled_from([4, 8]))
    lengths = draw(st.lists(st.integers(0, 3 * chunk_size), min_size=HYPOTHESIS_SEQS, max_size=HYPOTHESIS_SEQS))
    offsets = st.one_of(st.sampled_from([0, 1, chunk_size - 1]), st.integers(0, chunk_size - 1))
    starts = [draw(st.integers(0, 3)) * chunk_size + draw(offsets) for _ in range(HYPOTHESIS_SEQS)]
    num_groups = draw(st.sampled_from([1, 2, 4]))
    seed = draw(st.integers(0, 2**32 - 1))
    return lengths, starts, chunk_size, num_groups, seed


@given(ragged_cases())
@settings(max_examples=examples(15), deadline=None, database=None)
def test_random_batches_match_sequential(case):
    """Drawn segment lengths, start positions and chunk sizes; the rest of the fixed token
    count is padding garbage."""
    lengths, starts, chunk_size, num_groups, seed = case
    num_pad = hypothesis_tokens(chunk_size) - sum(lengths)
    inputs = make_inputs(np.random.default_rng(seed), lengths, starts, num_groups, num_pad)
    check_against_sequential(inputs, chunk_size)


def decode_inputs(rng, num_seqs: int, num_groups: int) -> dict:
    """One token per sequence, keyed by the argument names of `ssd_state_update`."""
    f32 = np.float32
    return {
        "state": rng.standard_normal((num_seqs, NUM_HEADS, HEAD_DIM, STATE_SIZE)).astype(f32),  # [S, H, P, N]
        "x": rng.standard_normal((num_seqs, NUM_HEADS, HEAD_DIM)).astype(f32),  # [S, H, P]
        "dt": rng.uniform(0.05, 0.3, (num_seqs, NUM_HEADS)).astype(f32),  # [S, H]
        "A": -rng.uniform(0.1, 1.5, NUM_HEADS).astype(f32),  # [H]
        "B": rng.standard_normal((num_seqs, num_groups, STATE_SIZE)).astype(f32),  # [S, G, N]
        "C": rng.standard_normal((num_seqs, num_groups, STATE_SIZE)).astype(f32),  # [S, G, N]
    }


@pytest.mark.parametrize("num_groups", [1, 2, 4])
def test_state_update_is_one_recurrence_step(num_groups):
    """The decode step equals one float64 step of the recurrence, sequence by sequence."""
    inp = decode_inputs(np.random.default_rng(10 + num_groups), 3, num_groups)
    y, new_state = ssd_state_update(**inp)
    f64 = {k: np.asarray(v, np.float64) for k, v in inp.items()}
    for s in range(3):
        want_y, want_state = recurrence_step(
            f64["state"][s], f64["x"][s], f64["dt"][s], f64["A"], f64["B"][s], f64["C"][s]
        )
        assert_close(y[s], want_y)
        assert_close(new_state[s], want_state)


@pytest.mark.parametrize("num_groups", [1, 2])
def test_state_update_matches_scan_on_single_tokens(num_groups):
    """The decode step equals the ragged scan over length-1 segments, whatever the start."""
    inp = decode_inputs(np.random.default_rng(20 + num_groups), 5, num_groups)
    y, new_state = ssd_state_update(**inp)
    scan = ragged_ssd_scan(
        **{name: inp[name] for name in ("x", "dt", "A", "B", "C")},
        init_states=inp["state"],
        cu_seqlens=cu_from_lengths([1] * 5),
        start_pos=np.asarray([0, 3, 7, 8, 15], np.int32),  # from 0, mid-chunk, before / on / past a boundary
        chunk_size=8,
    )
    assert_close(y, scan.y)
    assert_close(new_state, scan.final_states)


@settings(max_examples=examples(5), deadline=None)  # each example compiles anew
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
    starts=st.lists(st.integers(0, 40), min_size=4, max_size=4),
    chunk=st.sampled_from([4, 8, 16]),
    num_groups=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_states_at_any_position_match_the_recurrence(lengths, starts, chunk, num_groups, seed):
    """`ssd_states_at` gives the state after any position of the step, inside a chunk as well
    as at its end, equal to the float64 recurrence's; requests for padding stay harmless."""
    rng = np.random.default_rng(seed)
    start_pos = starts[: len(lengths)]
    inputs = make_inputs(rng, lengths, start_pos, num_groups, num_pad=3)
    scan = ragged_ssd_scan(**inputs, chunk_size=chunk)
    _, _, trajectories = sequential_scan(inputs)
    seqs, positions, want = [], [], []
    for s, length in enumerate(lengths):
        for i in rng.choice(length, size=min(length, 5), replace=False):
            seqs.append(s)
            positions.append(start_pos[s] + i + 1)
            want.append(trajectories[s][i])
    seqs.append(0)
    positions.append(-1)  # padding
    got = ssd_states_at(
        inputs["x"],
        inputs["dt"],
        inputs["A"],
        inputs["B"],
        inputs["init_states"],
        inputs["cu_seqlens"],
        inputs["start_pos"],
        scan,
        np.asarray(seqs, np.int32),
        np.asarray(positions, np.int32),
        window=chunk,
    )
    assert np.isfinite(np.asarray(got)).all()
    assert_close(np.asarray(got)[:-1], np.stack(want))
