"""Checks the Pallas SSD kernels against the pure-jnp reference, and that they lower.

The kernels run in interpret mode on CPU (the Mosaic TPU interpreter, and the Mosaic GPU
interpreter) on ragged batches drawn by hypothesis, and must reproduce every output of
`reference.ragged_ssd_scan` on the same inputs: the row layout (`chunk_seq`, `chunk_end`)
exactly, y (zero for padding), the final states and the state after every used row.

Tolerance: 1e-4 of the largest expected magnitude. Kernel and
reference both compute in float32 from the same input values (bfloat16 inputs are exact in
float32, and both upcast them before any arithmetic), so they differ only by rounding: the
order of the float32 sums (a chunk's quadratic form, tile by tile instead of at once), the
cumulative decays (a segmented scan instead of a masked cumsum), and in the GPU kernel the
bfloat16 hi + lo split of MMA operands (about 2^-16 relative per product). Each value sums
at most chunk_size * N products of magnitude ~1, so the difference stays near 1e-6 of the
magnitudes (measured: under 1e-5, also with decays down to e^-16 per token). That is why
bfloat16 inputs get the same tolerance as float32 ones: the reference is fed the same
bfloat16 values, so only the values differ, not the arithmetic (against a float32 truth the
bfloat16 rounding of the inputs, ~4e-3, would dominate, but that is not the kernel's error).
A real mistake (a missing decay, a token of the wrong row, a leaked padding value of ~1e3)
moves outputs by O(1) of their magnitude, far above 1e-4.

Poison: the padding tokens past the last sequence hold large garbage, NaN and inf in x, B,
C and dt (the reference drops them); any leak shows as a mismatch or a NaN. The TPU
interpreter also fills out-of-bounds reads of the partial last token block with NaN.
"""

import functools
from typing import NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from pallas_kernels.ssd import kernel_gpu, kernel_tpu
from pallas_kernels.ssd.reference import ragged_ssd_scan as reference_scan
from tests.pallas_kernels.scan_checks import assert_kernel_matches_reference
from tests.property_examples import examples

NUM_SEQS = 4  # S of every drawn batch


class Setup(NamedTuple):
    """One kernel configuration: the kernel (interpret mode) and the shapes it is tested with."""

    kernel: object  # jitted (inputs...) -> RaggedScanOutput
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    chunk_size: int
    max_len: int  # longest drawn sequence

    @property
    def num_tokens(self) -> int:
        """Fixed per setup so compilations repeat across examples; leaves >= 1 padding token."""
        return NUM_SEQS * self.max_len + 3


# TPU: P = 256 makes two head blocks of 2 heads (half a group per block for G = 1, one group
# for G = 2, two groups for G = 4); tile_size 4 < chunk 16 gives rows of up to 5 tiles.
TPU = Setup(
    jax.jit(functools.partial(kernel_tpu.ragged_ssd_scan, chunk_size=16, tile_size=4, interpret=True)),
    num_heads=4, head_dim=256, state_size=16, chunk_size=16, max_len=40,
)  # fmt: skip
# GPU: P and the tile are 64 (the wgmma granule), so a 64-token chunk spans up to 2 tiles.
GPU = Setup(
    jax.jit(functools.partial(kernel_gpu.ragged_ssd_scan, chunk_size=64, interpret=True)),
    num_heads=2, head_dim=64, state_size=32, chunk_size=64, max_len=100,
)  # fmt: skip
_reference = jax.jit(reference_scan, static_argnames="chunk_size")


def cu_from_lengths(lengths) -> np.ndarray:
    """[S] lengths -> [S + 1] int32 offsets."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def make_inputs(setup: Setup, lengths, starts, num_groups: int, dtype, seed: int, strong_decay: bool = False) -> dict:
    """Random inputs keyed by the argument names of `ragged_ssd_scan`; padding is poisoned.

    Decays exp(dt * A) lie in about [0.64, 0.995] per token, so initial states stay visible
    over a chunk; initial states are non-zero. With `strong_decay`, dt * A lies in [-16, -4]:
    log-decays reach -1000 within a row, so exp of a difference taken across rows overflows.
    """
    rng = np.random.default_rng(seed)
    num_tokens, num_heads, head_dim, state_size = setup.num_tokens, setup.num_heads, setup.head_dim, setup.state_size
    num_valid = int(sum(lengths))
    f32 = np.float32
    inputs = {
        "x": rng.standard_normal((num_tokens, num_heads, head_dim)).astype(f32),  # [T, H, P]
        "dt": rng.uniform(*((0.5, 1.0) if strong_decay else (0.05, 0.3)), (num_tokens, num_heads)).astype(
            f32
        ),  # [T, H]
        "A": -rng.uniform(*((8.0, 16.0) if strong_decay else (0.1, 1.5)), num_heads).astype(f32),  # [H]
        "B": rng.standard_normal((num_tokens, num_groups, state_size)).astype(f32),  # [T, G, N]
        "C": rng.standard_normal((num_tokens, num_groups, state_size)).astype(f32),  # [T, G, N]
        "init_states": rng.standard_normal((len(lengths), num_heads, head_dim, state_size)).astype(f32),
    }
    for name in ("x", "B", "C", "dt"):  # poison: large garbage, then NaN and inf in every other padding token
        pad = inputs[name][num_valid:]
        pad[...] = rng.uniform(1.0, 10.0, pad.shape) if name == "dt" else rng.uniform(-1e3, 1e3, pad.shape)
        pad[1::2] = np.inf if name == "dt" else np.nan
    inputs = {name: jnp.asarray(value, dtype) for name, value in inputs.items()}
    inputs["cu_seqlens"] = jnp.asarray(cu_from_lengths(lengths))  # [S + 1]
    inputs["start_pos"] = jnp.asarray(starts, jnp.int32)  # [S]
    return inputs


def check_against_reference(setup: Setup, lengths, starts, num_groups: int, dtype, seed: int, **options) -> None:
    """Runs `setup`'s kernel and the reference on the same drawn inputs and compares every output."""
    inputs = make_inputs(setup, lengths, starts, num_groups, dtype, seed, **options)
    got = setup.kernel(**inputs)
    want = _reference(**inputs, chunk_size=setup.chunk_size)
    assert_kernel_matches_reference(got, want, len(lengths), tol=1e-4)  # see the module docstring
    np.testing.assert_array_equal(np.asarray(got.y)[int(sum(lengths)) :], 0.0)  # padding tokens


@st.composite
def ragged_batches(draw, setup: Setup):
    """(lengths, starts, groups, dtype, seed) of a decode-only, prefill-only or mixed batch.

    Starts favour chunk boundaries and the positions just after and before one; segment
    ends favour landing exactly on a chunk boundary or one token past it; mixed batches
    also favour empty and one-token segments."""
    cs, max_len = setup.chunk_size, setup.max_len
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    lengths, starts = [], []
    for _ in range(NUM_SEQS):
        start = draw(st.integers(0, 3)) * cs + draw(st.one_of(st.sampled_from([0, 1, cs - 1]), st.integers(0, cs - 1)))
        shortest = 2 if kind == "prefill" else 0
        rule = (
            "one" if kind == "decode" else draw(st.sampled_from(["on", "past", "free"] + ["tiny"] * (kind == "mixed")))
        )
        if rule == "one":
            length = 1
        elif rule == "tiny":
            length = draw(st.sampled_from([0, 1]))
        elif rule == "free":
            length = draw(st.integers(shortest, max_len))
        else:  # end on a chunk boundary, or one token past it
            extra = int(rule == "past")
            ends = range((start // cs + 1) * cs, start + max_len + 1 - extra, cs)
            length = draw(st.sampled_from([e + extra - start for e in ends if e + extra - start >= shortest]))
        lengths.append(length)
        starts.append(start)
    num_groups = draw(st.sampled_from([1, 2] if setup.num_heads == 2 else [1, 2, 4]))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    return lengths, starts, num_groups, dtype, draw(st.integers(0, 2**32 - 1))


def mixed_example(cs: int):
    """Empty; mid-chunk start ending on a boundary; one token just before a boundary; start on a
    boundary ending one past the next one."""
    return ([0, cs - 3, 1, cs + 1], [5, 3, 2 * cs - 1, cs], 2, jnp.float32, 0)


@given(ragged_batches(TPU))
@example(mixed_example(TPU.chunk_size))
@example(([1] * NUM_SEQS, [0, 15, 16, 33], 4, jnp.bfloat16, 1))  # decode only
@example(([40, 17, 16, 2], [0, 16, 5, 31], 2, jnp.bfloat16, 2))  # prefill only
@example(([0] * NUM_SEQS, [3, 0, 16, 9], 1, jnp.float32, 3))  # no tokens at all
@settings(max_examples=examples(4), deadline=None, database=None)
def test_tpu_kernel_matches_reference(case):
    check_against_reference(TPU, *case)


@given(ragged_batches(GPU))
@example(mixed_example(GPU.chunk_size))
@example(([70, 64, 100, 2], [0, 128, 30, 63], 1, jnp.bfloat16, 1))  # prefill only
@example(([30, 98, 0, 0], [0, 30, 0, 0], 1, jnp.float32, 3))  # a shared y tile, then 128 real tokens
@example(([1] * NUM_SEQS, [0, 63, 64, 200], 2, jnp.bfloat16, 4))  # decode only
@example(([0] * NUM_SEQS, [3, 0, 64, 9], 2, jnp.float32, 5))  # no tokens at all
@settings(max_examples=examples(4), deadline=None, database=None)
def test_gpu_kernel_matches_reference(case):
    check_against_reference(GPU, *case)


@pytest.mark.parametrize("setup", [TPU, GPU], ids=["tpu", "gpu"])
def test_strong_decay(setup):
    """Masks must keep decays of tokens outside a row out of every exp (else inf * 0 = NaN)."""
    cs = setup.chunk_size
    check_against_reference(setup, [0, cs - 3, 1, cs + 1], [5, 3, 2 * cs - 1, cs], 1, jnp.float32, 7, strong_decay=True)


def test_gpu_kernel_two_column_slices_and_long_chunks():
    """P = 128 (two CTAs per head) and 128-token chunks (rows of up to 3 tiles)."""
    setup = GPU._replace(
        kernel=jax.jit(functools.partial(kernel_gpu.ragged_ssd_scan, chunk_size=128, interpret=True)),
        head_dim=128, chunk_size=128, max_len=140,
    )  # fmt: skip
    check_against_reference(setup, [140, 1, 0, 128], [70, 127, 3, 0], 2, jnp.float32, 2)


def shape_structs(dtype, num_tokens=1000, num_heads=16, head_dim=64, state_size=128, num_groups=2, num_seqs=4):
    """Realistic argument shapes of `ragged_ssd_scan` (T not a multiple of the chunk)."""
    f32 = jnp.float32
    return [
        jax.ShapeDtypeStruct((num_tokens, num_heads, head_dim), dtype),  # x
        jax.ShapeDtypeStruct((num_tokens, num_heads), f32),  # dt
        jax.ShapeDtypeStruct((num_heads,), f32),  # A
        jax.ShapeDtypeStruct((num_tokens, num_groups, state_size), dtype),  # B
        jax.ShapeDtypeStruct((num_tokens, num_groups, state_size), dtype),  # C
        jax.ShapeDtypeStruct((num_seqs, num_heads, head_dim, state_size), f32),  # init_states
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),  # cu_seqlens
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),  # start_pos
    ]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tpu_kernel_lowers_for_tpu(dtype):
    exported = jax.export.export(
        jax.jit(functools.partial(kernel_tpu.ragged_ssd_scan, chunk_size=256)), platforms=["tpu"]
    )(*shape_structs(dtype))
    assert exported.platforms == ("tpu",)
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize(("dtype", "state_size"), [(jnp.float32, 128), (jnp.bfloat16, 128), (jnp.bfloat16, 64)])
def test_gpu_kernel_lowers_for_cuda(dtype, state_size):
    """Lowering runs Mosaic GPU's layout and shared-memory checks (227 KiB per block)."""
    exported = jax.export.export(
        jax.jit(functools.partial(kernel_gpu.ragged_ssd_scan, chunk_size=256)), platforms=["cuda"]
    )(*shape_structs(dtype, state_size=state_size))
    assert exported.platforms == ("cuda",)
    assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize(
    ("kernel", "changes", "message"),
    [
        (kernel_tpu.ragged_ssd_scan, {"dt": (999, 16)}, "dt must be"),
        (kernel_tpu.ragged_ssd_scan, {"B": (1000, 3, 128), "C": (1000, 3, 128)}, "split evenly"),
        (kernel_tpu.ragged_ssd_scan, {"init_states": (4, 16, 64, 64)}, "init_states must be"),
        (kernel_tpu.ragged_ssd_scan, {"start_pos": (5,)}, "start_pos"),
        (kernel_gpu.ragged_ssd_scan, {"x": (1000, 16, 96), "init_states": (4, 16, 96, 128)}, "head_dim"),
        (kernel_gpu.ragged_ssd_scan, {"B": (1000, 2, 256), "C": (1000, 2, 256), "init_states": (4, 16, 64, 256)}, "state_size"),
    ],
)  # fmt: skip
def test_bad_shapes_are_rejected(kernel, changes, message):
    names = ["x", "dt", "A", "B", "C", "init_states", "cu_seqlens", "start_pos"]
    args = {name: jnp.zeros(s.shape, s.dtype) for name, s in zip(names, shape_structs(jnp.float32))}
    args.update({name: jnp.zeros(shape, args[name].dtype) for name, shape in changes.items()})
    with pytest.raises(ValueError, match=message):
        kernel(**args, chunk_size=256)


def test_bad_chunk_and_tile_sizes_are_rejected():
    args = [jnp.zeros(s.shape, s.dtype) for s in shape_structs(jnp.float32)]
    with pytest.raises(ValueError, match="chunk_size"):
        kernel_gpu.ragged_ssd_scan(*args, chunk_size=0)
    with pytest.raises(ValueError, match="tile_size"):
        kernel_tpu.ragged_ssd_scan(*args, chunk_size=256, tile_size=96)
