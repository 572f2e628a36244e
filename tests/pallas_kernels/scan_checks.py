"""What the chunked-scan tests check alike: the states a scan returns against a float64
recurrence's state after every token, and a kernel's outputs against the reference's."""

import jax.numpy as jnp
import numpy as np

from tests.pallas_kernels.tolerance import assert_close_to_scale


def assert_scan_states(
    got, want_states: list[list[np.ndarray]], init_states, lengths, starts, chunk: int, assert_close
) -> None:
    """Each sequence's final state (its initial one if it has no tokens) and each used row's
    end state, which must be the state after its absolute end position (a chunk boundary or
    the sequence's end). `want_states[s][i]`: sequence s's state after its i-th token."""
    for s, after in enumerate(want_states):
        assert_close(got.final_states[s], after[-1] if after else np.asarray(init_states[s], np.float64))
    for r in range(got.chunk_seq.shape[0]):
        s = int(got.chunk_seq[r])
        if s < len(lengths):
            end = int(got.chunk_end[r])
            assert end % chunk == 0 or end == starts[s] + lengths[s]
            assert_close(got.chunk_states[r], want_states[s][end - starts[s] - 1])


def every_position(lengths, starts, num_requests: int) -> tuple[jnp.ndarray, jnp.ndarray, int]:
    """State requests after every position of every sequence, padded to `num_requests`:
    (seq, pos) int32 arrays and how many are real."""
    seqs = [s for s, n in enumerate(lengths) for _ in range(n)]
    pos = [starts[s] + i + 1 for s, n in enumerate(lengths) for i in range(n)]
    padding = [0] * (num_requests - len(seqs))
    return jnp.asarray(seqs + padding, jnp.int32), jnp.asarray(pos + padding, jnp.int32), len(seqs)


def states_after(want_states: list[list[np.ndarray]], seq, pos, starts, count: int) -> np.ndarray:
    """The recurrence's states at the first `count` requests."""
    return np.stack(
        [want_states[s][p - starts[s] - 1] for s, p in zip(np.asarray(seq[:count]), np.asarray(pos[:count]))]
    )


def assert_kernel_matches_reference(got, want, num_seqs: int, *, tol: float) -> None:
    """A kernel's scan outputs against the reference's on the same inputs: the row layout
    exactly, every other field (the first is the per-token output) to `tol` of its scale,
    the row states for the used rows only (the others are unspecified)."""
    for name in want._fields:
        assert getattr(got, name).shape == getattr(want, name).shape, name
        assert getattr(got, name).dtype == getattr(want, name).dtype, name
    np.testing.assert_array_equal(got.chunk_seq, want.chunk_seq)
    np.testing.assert_array_equal(got.chunk_end, want.chunk_end)
    assert_close_to_scale(got[0], want[0], tol=tol)
    assert_close_to_scale(got.final_states, want.final_states, tol=tol)
    used = np.asarray(want.chunk_seq) < num_seqs
    assert_close_to_scale(np.asarray(got.chunk_states)[used], np.asarray(want.chunk_states)[used], tol=tol)
