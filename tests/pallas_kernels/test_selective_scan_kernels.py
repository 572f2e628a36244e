"""Checks the Pallas TPU and GPU selective-scan (Mamba-1) kernels against the pure-jnp
reference, and that they lower.

The kernels run in interpret mode on CPU (the Mosaic TPU interpreter, and the Mosaic GPU
interpreter) on ragged batches drawn by hypothesis
(segments of length 0, 1 and at chunk edges, starts inside chunks, float32 and bfloat16
inputs; the GPU kernel's 128 channels a block) and must reproduce every output of
`reference.ragged_selective_scan` on the same
inputs: the row layout exactly, the outputs (zero for padding), the final states and the
state after every used row.

Tolerance: 1e-4 of the largest expected magnitude, as in the reference's own test. Kernel
and reference compute the same float32 recurrence from the same input values, in another
order (one pass from the rows' start states against the reference's two), so they differ by
rounding (~1e-7). A real mistake (a token of the wrong row or column, a state not carried,
a leaked padding value of ~1e3) moves outputs by O(1).
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels.selective_scan import kernel_gpu, kernel_tpu, ragged_selective_scan
from tests.pallas_kernels.scan_checks import assert_kernel_matches_reference
from tests.pallas_kernels.test_selective_scan_reference import NUM_SEQS, NUM_TOKENS, make_inputs
from tests.property_examples import examples

CHUNK = 8

KERNELS = {
    "tpu": (jax.jit(functools.partial(kernel_tpu.ragged_selective_scan, chunk_size=CHUNK, interpret=True)), 6),
    "gpu": (jax.jit(functools.partial(kernel_gpu.ragged_selective_scan, chunk_size=CHUNK, interpret=True)), 128),
}  # the kernel in interpret mode, and the channels it is tested with
reference = jax.jit(functools.partial(ragged_selective_scan, chunk_size=CHUNK))


@pytest.mark.parametrize("platform", sorted(KERNELS))
@settings(max_examples=examples(6), deadline=None)
@given(
    lengths=st.lists(
        st.sampled_from([0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]), min_size=NUM_SEQS, max_size=NUM_SEQS
    ),
    starts=st.lists(st.sampled_from([0, 1, CHUNK - 1, CHUNK + 2]), min_size=NUM_SEQS, max_size=NUM_SEQS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_kernel_matches_reference(platform, lengths, starts, dtype, seed):
    kernel, channels = KERNELS[platform]
    rng = np.random.default_rng(seed)
    inputs = make_inputs(rng, lengths, starts, NUM_TOKENS - sum(lengths), dtype, channels=channels, state=8)
    got, want = kernel(**inputs), reference(**inputs)
    assert_kernel_matches_reference(got, want, NUM_SEQS, tol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("kernel", "platform", "marker"), [(kernel_tpu, "tpu", "tpu_custom_call"), (kernel_gpu, "cuda", "mosaic_gpu")]
)
def test_kernel_lowers(kernel, platform, marker, dtype):
    """Jamba-Mini's shapes: 8192 channels, state 16, chunk 64. For the GPU kernel, lowering
    runs Mosaic GPU's layout and shared-memory checks."""
    tokens, seqs, channels, state = 256, 4, 8192, 16
    f = jax.ShapeDtypeStruct
    args = (
        f((tokens, channels), dtype),
        f((tokens, channels), jnp.float32),
        f((channels, state), jnp.float32),
        f((tokens, state), dtype),
        f((tokens, state), dtype),
        f((seqs, channels, state), jnp.float32),
        f((seqs + 1,), jnp.int32),
        f((seqs,), jnp.int32),
    )
    exported = jax.export.export(
        jax.jit(functools.partial(kernel.ragged_selective_scan, chunk_size=64)), platforms=[platform]
    )(*args)
    assert exported.platforms == (platform,)
    assert marker in exported.mlir_module()


def test_gpu_kernel_on_a_batch_without_padding_tokens():
    """Every token belongs to a sequence, so the last token ends a used row: the rows a
    batch does not use must not claim it (they once overwrote the last row's state)."""
    lengths, starts = [CHUNK + 1, 0, 2 * CHUNK + 3, 5], [1, 0, CHUNK - 1, 0]
    inputs = make_inputs(np.random.default_rng(3), lengths, starts, 0, jnp.float32, channels=128, state=8)
    kernel = KERNELS["gpu"][0]
    assert_kernel_matches_reference(kernel(**inputs), reference(**inputs), NUM_SEQS, tol=1e-4)


def test_gpu_kernel_refuses_shapes_it_does_not_take():
    inputs = make_inputs(np.random.default_rng(0), [3], [0], 0, jnp.float32, channels=96, state=8)
    with pytest.raises(ValueError, match="multiple of 128"):
        kernel_gpu.ragged_selective_scan(**inputs, chunk_size=CHUNK)
