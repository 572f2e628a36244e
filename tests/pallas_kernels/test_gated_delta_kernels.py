"""Checks the Pallas TPU and GPU gated-delta kernels against the pure-jnp reference, and that
they lower.

The kernels run in interpret mode on CPU (the Mosaic TPU interpreter, and the Mosaic GPU
interpreter) on ragged batches drawn by hypothesis (segments of length 0, 1 and at chunk
edges, starts inside chunks, grouped value heads, float32 and bfloat16 inputs; for the GPU
kernel, 64 value columns a block and d_k = 16) and must reproduce every output of
`reference.ragged_gated_delta` on the same inputs: the row layout exactly, the outputs (zero
for padding), the final states and the state after every used row. The GPU kernel walks each
sequence in 64-token tiles, so it also runs on sequences longer than a tile, on two value
column blocks, and on a batch without padding tokens.

Tolerance: 1e-4 of the largest expected magnitude, as in the reference's own test. Kernel
and reference compute in float32 from the same input values; they differ only in how the
unit lower triangular system is solved (forward substitution against XLA's triangular solve;
the GPU kernel runs the recurrence token by token instead) and in the order of sums, so by
rounding (measured: ~1e-7). A real mistake (a wrong decay, a token of the wrong row, a
leaked padding value of ~1e3) moves outputs by O(1).
"""

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from pallas_kernels.gated_delta import kernel_gpu, kernel_tpu, ragged_gated_delta
from tests.pallas_kernels.scan_checks import assert_kernel_matches_reference
from tests.pallas_kernels.test_gated_delta_reference import NUM_SEQS, NUM_TOKENS, l2_normalised, make_inputs
from tests.property_examples import examples

CHUNK = 8
SCALE = 0.35

kernel = jax.jit(functools.partial(kernel_tpu.ragged_gated_delta, chunk_size=CHUNK, scale=SCALE, interpret=True))
gpu_kernel = jax.jit(functools.partial(kernel_gpu.ragged_gated_delta, chunk_size=CHUNK, scale=SCALE, interpret=True))
reference = jax.jit(functools.partial(ragged_gated_delta, chunk_size=CHUNK, scale=SCALE))

# Ragged batches: segments of length 0, 1 and at chunk edges, starts inside chunks, float32
# and bfloat16 inputs.
RAGGED_BATCHES = dict(
    lengths=st.lists(
        st.sampled_from([0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3]), min_size=NUM_SEQS, max_size=NUM_SEQS
    ),
    starts=st.lists(st.sampled_from([0, 1, CHUNK - 1, CHUNK + 2]), min_size=NUM_SEQS, max_size=NUM_SEQS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    seed=st.integers(0, 2**31 - 1),
)


@settings(max_examples=examples(8), deadline=None)
@given(**RAGGED_BATCHES)
def test_tpu_kernel_matches_reference(lengths, starts, dtype, seed):
    # Two key heads, each read by four value heads: one head block of 8 (the TPU block size).
    inputs = make_inputs(np.random.default_rng(seed), lengths, starts, 2, 4, NUM_TOKENS - sum(lengths), dtype)
    got, want = kernel(**inputs), reference(**inputs)
    assert_kernel_matches_reference(got, want, NUM_SEQS, tol=1e-4)


def qwen_shapes(dtype, key_dim: int = 128, value_dim: int = 128) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Qwen3.5's shapes: 16 key heads read by 32 value heads, 256 tokens of 4 sequences."""
    tokens, seqs, key_heads, heads = 256, 4, 16, 32
    f = jax.ShapeDtypeStruct
    return (
        f((tokens, key_heads, key_dim), dtype),
        f((tokens, key_heads, key_dim), dtype),
        f((tokens, heads, value_dim), dtype),
        f((tokens, heads), jnp.float32),
        f((tokens, heads), jnp.float32),
        f((seqs, heads, key_dim, value_dim), jnp.float32),
        f((seqs + 1,), jnp.int32),
        f((seqs,), jnp.int32),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("kernel_module", "platform", "marker"),
    [(kernel_tpu, "tpu", "tpu_custom_call"), (kernel_gpu, "cuda", "mosaic_gpu")],
)
def test_kernel_lowers(kernel_module, platform, marker, dtype):
    """Chunk 64, d_k = d_v = 128. For the GPU kernel, lowering runs Mosaic GPU's layout and
    shared-memory checks."""
    exported = jax.export.export(
        jax.jit(functools.partial(kernel_module.ragged_gated_delta, chunk_size=64, scale=128**-0.5)),
        platforms=[platform],
    )(*qwen_shapes(dtype))
    assert exported.platforms == (platform,)
    assert marker in exported.mlir_module()


def gpu_inputs(rng, lengths, starts, key_heads: int, ratio: int, num_pad: int, dtype, key_dim=16, value_dim=64) -> dict:
    """`make_inputs`' distributions at shapes the GPU kernel takes (d_v a multiple of 64)."""
    num_valid, heads = int(sum(lengths)), key_heads * ratio
    num_tokens = num_valid + num_pad
    inputs = {
        "q": l2_normalised(rng.standard_normal((num_tokens, key_heads, key_dim))),
        "k": l2_normalised(rng.standard_normal((num_tokens, key_heads, key_dim))),
        "v": rng.standard_normal((num_tokens, heads, value_dim)),
        "g": -rng.uniform(0.01, 0.5, (num_tokens, heads)),
        "beta": rng.uniform(0.1, 0.9, (num_tokens, heads)),
        "init_states": rng.standard_normal((len(lengths), heads, key_dim, value_dim)),
    }
    for name in ("q", "k", "v", "g", "beta"):  # padding tokens: large garbage
        inputs[name][num_valid:] = rng.uniform(-1e3, 1e3, inputs[name][num_valid:].shape)
    inputs = {name: jnp.asarray(value, dtype) for name, value in inputs.items()}
    inputs["cu_seqlens"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    inputs["start_pos"] = np.asarray(starts, np.int32)
    return inputs


@settings(max_examples=examples(5), deadline=None)
@given(**RAGGED_BATCHES)
def test_gpu_kernel_matches_reference(lengths, starts, dtype, seed):
    # Two key heads, each read by two value heads: four (sequence, head) blocks per sequence.
    inputs = gpu_inputs(np.random.default_rng(seed), lengths, starts, 2, 2, NUM_TOKENS - sum(lengths), dtype)
    got, want = gpu_kernel(**inputs), reference(**inputs)
    assert_kernel_matches_reference(got, want, NUM_SEQS, tol=1e-4)


def test_gpu_kernel_long_sequences_two_column_blocks_no_padding():
    """Sequences of more than a 64-token tile (whole tiles stored at once, then a partial one
    token by token), d_v = 128 (two column blocks), two value heads on one key head, and no
    padding token: the last flat token ends a row while unused rows remain."""
    lengths, starts = [70, 1, 0, 66], [3, 7, 0, 62]
    inputs = gpu_inputs(np.random.default_rng(5), lengths, starts, 1, 2, 0, jnp.float32, value_dim=128)
    got, want = gpu_kernel(**inputs), reference(**inputs)
    assert (np.asarray(want.chunk_seq) == len(lengths)).any()  # unused rows exist
    assert_kernel_matches_reference(got, want, len(lengths), tol=1e-4)


@pytest.mark.parametrize(
    ("key_dim", "value_dim", "message"),
    [(128, 96, "value_dim"), (256, 128, "key_dim"), (12, 64, "key_dim")],
)
def test_gpu_kernel_refuses_shapes_it_does_not_take(key_dim, value_dim, message):
    args = [jnp.zeros(s.shape, s.dtype) for s in qwen_shapes(jnp.float32, key_dim, value_dim)]
    with pytest.raises(ValueError, match=message):
        kernel_gpu.ragged_gated_delta(*args, chunk_size=64, scale=1.0)
