"""Checks the pure-jnp causal conv1d reference against a float64 numpy convolution.

The numpy reference appends a sequence's columns to its conv state's K columns and slides
the depthwise kernel over that concatenation token by token; the new state is its last K
columns. The code under test sums K float32 products per output, so its error is a few ulps
of the magnitudes (~1e-6 here); `assert_close` allows 1e-5 of the largest expected
magnitude, far below the O(1) change of any real mistake.
"""

import functools

import numpy as np
import pytest

from pallas_kernels.causal_conv1d.reference import causal_conv1d_update, ragged_causal_conv1d
from tests.pallas_kernels.tolerance import assert_close_to_scale

CHANNELS = 6  # D


assert_close = functools.partial(assert_close_to_scale, tol=1e-5)  # see the module docstring


def cu_from_lengths(lengths: list[int]) -> np.ndarray:
    """[S] lengths -> [S + 1] int32 offsets."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def conv_params(rng, kernel: int, with_bias: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """weight [D, K] and bias [D] (or None), float32."""
    weight = rng.standard_normal((CHANNELS, kernel)).astype(np.float32)
    bias = rng.standard_normal(CHANNELS).astype(np.float32) if with_bias else None
    return weight, bias


def numpy_conv(x, weight, bias, conv_states, cu_seqlens):
    """Float64 reference, sequence by sequence and token by token.

    x [T, D], weight [D, K], bias [D] or None, conv_states [S, D, K], cu_seqlens [S + 1]
    -> (out [T, D], zero for padding tokens; new states [S, D, K]).
    """
    kernel = weight.shape[1]
    weight = weight.astype(np.float64)
    bias = np.zeros(CHANNELS) if bias is None else bias.astype(np.float64)
    out = np.zeros(x.shape)
    new_states = np.empty(conv_states.shape)
    for s in range(len(cu_seqlens) - 1):
        tokens = range(cu_seqlens[s], cu_seqlens[s + 1])
        columns = np.concatenate([conv_states[s], x[tokens].T], axis=1).astype(np.float64)  # [D, K + L]
        for i, t in enumerate(tokens):
            window = columns[:, i + 1 : i + 1 + kernel]  # [D, K], ends at the token's own column K + i
            out[t] = bias + np.sum(weight * window, axis=1)
        new_states[s] = columns[:, -kernel:]
    return out, new_states


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("kernel", [3, 4])
def test_ragged_matches_numpy(kernel, with_bias):
    """Lengths 0, 1, < K, == K and > K in one batch, plus padding tokens holding garbage."""
    rng = np.random.default_rng(kernel + 10 * with_bias)
    lengths = [0, 1, kernel - 1, kernel, 2 * kernel + 1, 0]
    num_valid, num_pad = sum(lengths), 3
    x = rng.standard_normal((num_valid + num_pad, CHANNELS)).astype(np.float32)  # [T, D]
    x[num_valid:] = rng.uniform(-1e4, 1e4, (num_pad, CHANNELS))
    conv_states = rng.standard_normal((len(lengths), CHANNELS, kernel)).astype(np.float32)  # [S, D, K]
    weight, bias = conv_params(rng, kernel, with_bias)
    cu = cu_from_lengths(lengths)

    out, new_states = ragged_causal_conv1d(x, weight, bias, conv_states, cu)
    want_out, want_states = numpy_conv(x, weight, bias, conv_states, cu)
    assert_close(out, want_out)
    np.testing.assert_array_equal(np.asarray(out)[num_valid:], 0.0)  # padding tokens
    assert_close(new_states, want_states)  # empty sequences keep their state


@pytest.mark.parametrize("with_bias", [False, True])
def test_update_matches_numpy_and_ragged(with_bias):
    """The decode step equals the numpy reference and the ragged conv on length-1 segments."""
    rng = np.random.default_rng(30 + with_bias)
    num_seqs, kernel = 3, 4
    x = rng.standard_normal((num_seqs, CHANNELS)).astype(np.float32)  # [S, D]
    conv_state = rng.standard_normal((num_seqs, CHANNELS, kernel)).astype(np.float32)  # [S, D, K]
    weight, bias = conv_params(rng, kernel, with_bias)
    cu = cu_from_lengths([1] * num_seqs)

    out, new_state = causal_conv1d_update(x, weight, bias, conv_state)
    want_out, want_state = numpy_conv(x, weight, bias, conv_state, cu)
    assert_close(out, want_out)
    assert_close(new_state, want_state)
    ragged_out, ragged_state = ragged_causal_conv1d(x, weight, bias, conv_state, cu)
    assert_close(out, ragged_out)
    assert_close(new_state, ragged_state)
