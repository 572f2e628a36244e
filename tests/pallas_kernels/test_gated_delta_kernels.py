"""Checks the Pallas TPU gated-delta kernel against the pure-jnp reference, and that it lowers.

The kernel runs in the Mosaic TPU interpreter on CPU on ragged batches drawn by hypothesis
(segments of length 0, 1 and at chunk edges, starts inside chunks, grouped value heads,
float32 and bfloat16 inputs) and must reproduce every output of `reference.ragged_gated_delta`
on the same inputs: the row layout exactly, the outputs (zero for padding), the final states
and the state after every used row.

Tolerance: 1e-4 of the largest expected magnitude, as in the reference's own test. Kernel
and reference compute in float32 from the same input values; they differ only in how the
unit lower triangular system is solved (forward substitution against XLA's triangular solve)
and in the order of sums, so by rounding (measured: ~1e-7). A real mistake (a wrong decay, a
token of the wrong row, a leaked padding value of ~1e3) moves outputs by O(1).
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels.gated_delta import kernel_tpu, ragged_gated_delta
from tests.pallas_kernels.scan_checks import assert_kernel_matches_reference
from tests.pallas_kernels.test_gated_delta_reference import NUM_SEQS, NUM_TOKENS, make_inputs

CHUNK = 8
SCALE = 0.35

kernel = jax.jit(functools.partial(kernel_tpu.ragged_gated_delta, chunk_size=CHUNK, scale=SCALE, interpret=True))
reference = jax.jit(functools.partial(ragged_gated_delta, chunk_size=CHUNK, scale=SCALE))


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.sampled_from([0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]), min_size=NUM_SEQS,
                     max_size=NUM_SEQS),
    starts=st.lists(st.sampled_from([0, 1, CHUNK - 1, CHUNK + 2]), min_size=NUM_SEQS, max_size=NUM_SEQS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tpu_kernel_matches_reference(lengths, starts, dtype, seed):
    # Two key heads, each read by four value heads: one head block of 8 (the TPU block size).
    inputs = make_inputs(np.random.default_rng(seed), lengths, starts, 2, 4, NUM_TOKENS - sum(lengths), dtype)
    got, want = kernel(**inputs), reference(**inputs)
    assert_kernel_matches_reference(got, want, NUM_SEQS, tol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_kernel_lowers_for_tpu(dtype):
    """Qwen3.5's shapes: 16 key heads of 128 read by 32 value heads of 128, chunk 64."""
    tokens, seqs, key_heads, heads, dim = 256, 4, 16, 32, 128
    f = jax.ShapeDtypeStruct
    args = (f((tokens, key_heads, dim), dtype), f((tokens, key_heads, dim), dtype), f((tokens, heads, dim), dtype),
            f((tokens, heads), jnp.float32), f((tokens, heads), jnp.float32), f((seqs, heads, dim, dim), jnp.float32),
            f((seqs + 1,), jnp.int32), f((seqs,), jnp.int32))
    exported = jax.export.export(
        jax.jit(functools.partial(kernel_tpu.ragged_gated_delta, chunk_size=64, scale=dim**-0.5)), platforms=["tpu"]
    )(*args)
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()
