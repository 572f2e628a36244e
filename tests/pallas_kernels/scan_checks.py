"""What the chunked-scan reference tests check alike: the states a scan returns against a
float64 recurrence's state after every token."""

import jax.numpy as jnp
import numpy as np


def assert_scan_states(got, want_states: list[list[np.ndarray]], init_states, lengths, starts, chunk: int,
                       assert_close) -> None:
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
    return np.stack([want_states[s][p - starts[s] - 1] for s, p in zip(np.asarray(seq[:count]), np.asarray(pos[:count]))])
