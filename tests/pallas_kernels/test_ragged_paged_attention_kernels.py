"""The Pallas ragged paged attention kernels against the pure-jnp reference.

Both kernels run in interpret mode on CPU: the TPU kernel under `pltpu.InterpretParams()`
(simulated DMAs and semaphores), the GPU (Triton) kernel under the generic Pallas
interpreter. Batches are drawn with hypothesis, plus explicit examples that pin down GQA
ratios 1, 4 and 8, head dims 64 and 128, both dtypes, and decode-only, prefill-only and
mixed batches; segments have 0 and 1 tokens and contexts end on and just past page
boundaries.

Poison: every page slot outside the sequences' contexts holds NaN keys; its values are
1e6 in pages the reference gathers (page 0, the null sink, and the unused tail of each
last page: the reference multiplies them by exact zero probabilities, so they must be
finite) and NaN in spare pages nobody owns. Padding query tokens are NaN. Both
interpreters fill outputs and scratch with NaN, so an unwritten output element, or a stale
slot whose values are not masked, fails too. A key read from the wrong slot or page shows
up as NaN or as a 1e6-sized error.

Tolerances. float32: both sides take float32 dot products and a float32 softmax; they
differ only in summation order and in the online rescaling, ~1e-6 of the O(1) outputs,
so 2e-5 absolute and relative. bfloat16: inputs are identical bfloat16 values and the
scores are exact-product float32 sums on both sides, but the probabilities are rounded to
bfloat16 before the PV product (the reference rounds them normalised, the kernels round
them before dividing by the row sum) and the output is rounded to bfloat16. Each rounding
is at most 2^-8 relative (half an ulp), so each side is within 2^-8 max|v| of the exact
result before the final rounding, and the two rounded outputs differ by at most
2 * 2^-8 max|v| + one ulp (2^-7 max|v|) = 2^-6 max|v|, max|v| over the real context values.
A mask or page error is O(max|v|) or NaN.
"""

import dataclasses
import functools
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings

from pallas_kernels.ragged_paged_attention import kernel_gpu, kernel_tpu
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention as reference
from tests.property_examples import examples

KERNELS = {"tpu": kernel_tpu.ragged_paged_attention, "gpu": kernel_gpu.ragged_paged_attention}
# Block-size overrides per kernel, as functions of the case: the defaults, and the
# smallest legal blocks, which split a batch into many query blocks, KV blocks and (TPU)
# KV-head blocks.
BLOCKS = {
    "tpu": [
        lambda case: {},
        lambda case: {"block_q": 16, "block_kv_pages": 1, "block_kv_heads": min(case.kv_heads, 128 // case.head_dim)},
        lambda case: {"block_q": 32, "block_kv_pages": 2},
    ],
    "gpu": [
        lambda case: {},
        lambda case: {"block_q": 16 // case.group, "block_kv": 16},  # 16 query rows
        lambda case: {"block_q": 32 // case.group, "block_kv": 32},
    ],
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
BIG = 1e6  # values of slots the reference gathers but must not weigh


@dataclasses.dataclass(frozen=True)
class Case:
    q_lens: tuple[int, ...]  # query tokens per sequence this step
    kv_lens: tuple[int, ...]  # context per sequence, this step's tokens included
    page_size: int
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    dtype: str
    num_pad: int  # padding tokens after the last sequence
    sliding_window: int | None
    soft_cap: float | None
    blocks: int  # index into BLOCKS[kernel]
    seed: int


def context_len(draw, min_len: int, page_size: int) -> int:
    """A context of at least min_len tokens, often ending exactly on or just past a page
    boundary (up to two pages and one token)."""
    end = draw(st.sampled_from(["on", "past", "any"]))
    if end == "any":
        return draw(st.integers(min_len, min_len + 2 * page_size))
    pages = draw(st.integers(-(-min_len // page_size), 2))
    return max(min_len, pages * page_size + (end == "past"))


@st.composite
def cases(draw) -> Case:
    page_size = draw(st.sampled_from([4, 8, 16]))
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    q_lens, kv_lens = [], []
    for _ in range(draw(st.integers(1, 4))):
        seq_kind = kind if kind != "mixed" else draw(st.sampled_from(["decode", "prefill", "chunked", "empty"]))
        if seq_kind == "decode":
            q_len = 1
            kv_len = context_len(draw, 1, page_size)
        elif seq_kind == "prefill":  # the whole context this step; zero-length included
            kv_len = q_len = context_len(draw, 0, page_size)
        elif seq_kind == "chunked":  # the last q_len tokens of a longer context
            q_len = draw(st.integers(1, 8))
            kv_len = context_len(draw, q_len + 1, page_size)
        else:  # a padded sequence slot, or a sequence without tokens this step
            q_len, kv_len = 0, draw(st.sampled_from([0, page_size]))
        q_lens.append(q_len)
        kv_lens.append(kv_len)
    return Case(
        q_lens=tuple(q_lens),
        kv_lens=tuple(kv_lens),
        page_size=page_size,
        kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 4, 8])),
        head_dim=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from(sorted(DTYPES))),
        num_pad=draw(st.integers(0, 3)),
        sliding_window=draw(st.sampled_from([None, None, 1, 5, 13])),
        soft_cap=draw(st.sampled_from([None, None, 3.0])),
        blocks=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_inputs(case: Case):
    """Returns (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens) as jax arrays and the
    largest |value| in the real contexts (see the module docstring for the poison)."""
    rng = np.random.default_rng(case.seed)
    ps, hkv, d = case.page_size, case.kv_heads, case.head_dim
    needed = [math.ceil(n / ps) for n in case.kv_lens]
    pages_per_seq = max(needed) + 1  # at least one entry per sequence points at page 0
    num_pages = 1 + sum(needed) + 2  # null page, owned pages, two spare pages
    pool = rng.permutation(np.arange(1, num_pages))
    page_indices = np.zeros((len(needed), pages_per_seq), np.int32)
    k_pages = np.full((num_pages, ps, hkv, d), np.nan, np.float32)
    v_pages = np.full((num_pages, ps, hkv, d), np.nan, np.float32)
    v_pages[0] = BIG
    for s, (n, kv_len) in enumerate(zip(needed, case.kv_lens)):
        pages = pool[sum(needed[:s]) : sum(needed[: s + 1])]
        page_indices[s, :n] = pages
        v_pages[pages] = BIG
        for pos in range(kv_len):
            k_pages[pages[pos // ps], pos % ps] = rng.standard_normal((hkv, d))
            v_pages[pages[pos // ps], pos % ps] = rng.standard_normal((hkv, d))
    num_valid = sum(case.q_lens)
    q = np.full((num_valid + case.num_pad, hkv * case.group, d), np.nan, np.float32)
    q[:num_valid] = rng.standard_normal((num_valid, hkv * case.group, d))
    cu_q_lens = np.concatenate([[0], np.cumsum(case.q_lens)]).astype(np.int32)
    dtype = DTYPES[case.dtype]
    arrays = (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(case.kv_lens, jnp.int32),
        jnp.asarray(page_indices),
        jnp.asarray(cu_q_lens),
    )
    real_v = np.asarray(arrays[2], np.float32)[np.abs(v_pages) < BIG / 2]
    return arrays, float(np.abs(real_v).max(initial=1.0))


def check_kernel(kernel_name: str, case: Case) -> None:
    arrays, max_v = make_inputs(case)
    options = {"sm_scale": case.head_dim**-0.5, "sliding_window": case.sliding_window, "soft_cap": case.soft_cap}
    want = np.asarray(reference(*arrays, **options), np.float32)
    got = KERNELS[kernel_name](*arrays, **options, **BLOCKS[kernel_name][case.blocks](case), interpret=True)
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = {"float32": {"rtol": 2e-5, "atol": 2e-5}, "bfloat16": {"rtol": 0.0, "atol": 2**-6 * max_v}}[case.dtype]
    np.testing.assert_allclose(got, want, **tol)
    np.testing.assert_array_equal(got[sum(case.q_lens) :], 0.0)  # padding tokens


def named(kind: str, group: int, head_dim: int, dtype: str, blocks: int = 0, **kwargs) -> Case:
    """Explicit examples: decode-only, prefill-only and mixed batches."""
    batches = {
        # (q_len, kv_len): contexts ending on (16, 8) and just past (17, 9) page boundaries
        "decode": ((1, 17), (1, 8), (1, 1), (1, 9)),
        "prefill": ((9, 9), (8, 8), (0, 0), (1, 1)),
        "mixed": ((1, 17), (0, 0), (9, 9), (5, 21), (0, 8), (1, 16)),
    }[kind]
    defaults = {"page_size": 8, "kv_heads": 2, "num_pad": 2, "sliding_window": None, "soft_cap": None, "seed": 7}
    return Case(
        q_lens=tuple(q for q, _ in batches),
        kv_lens=tuple(n for _, n in batches),
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        blocks=blocks,
        **{**defaults, **kwargs},
    )


EXAMPLES = [
    # Window 2: multi-token items whose later rows cut keys the first row still sees, and
    # windows starting on the last slot of a page (the decode token at position 16).
    named("mixed", 1, 64, "float32", blocks=1, sliding_window=2),
    named("mixed", 8, 128, "float32", blocks=2),
    named("decode", 4, 128, "bfloat16", sliding_window=6),
    named("prefill", 8, 64, "float32", blocks=2, soft_cap=2.0),
    named("mixed", 4, 128, "bfloat16", blocks=1, kv_heads=1),
]


def with_examples(test):
    for case in EXAMPLES:
        test = example(case=case)(test)
    return test


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
@settings(max_examples=examples(4), deadline=None, database=None, derandomize=True)
@with_examples
@given(case=cases())
def test_kernel_matches_reference(kernel_name, case):
    check_kernel(kernel_name, case)


@pytest.mark.parametrize("kernel_name", sorted(KERNELS))
def test_kernel_validates_inputs(kernel_name):
    """The kernels run the reference's `validate_inputs` before building anything."""
    arrays, _ = make_inputs(named("decode", 1, 64, "float32"))
    bad_cu_q_lens = arrays[5][:-1]
    with pytest.raises(ValueError, match="cu_q_lens"):
        KERNELS[kernel_name](*arrays[:5], bad_cu_q_lens, sm_scale=1.0, interpret=True)


# Lowering for the real hardware, checked without it: realistic shapes (32 query heads,
# 8 KV heads, head_dim 128, pages of 16, 64 pages (1024 tokens) per sequence).
def shape_structs(dtype, head_dim=128, num_tokens=256, num_seqs=8, num_pages=512, pages_per_seq=64):
    page_shape = jax.ShapeDtypeStruct((num_pages, 16, 8, head_dim), dtype)
    return (
        jax.ShapeDtypeStruct((num_tokens, 32, head_dim), dtype),
        page_shape,
        page_shape,
        jax.ShapeDtypeStruct((num_seqs,), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((num_seqs + 1,), jnp.int32),
    )


LOWERING_OPTIONS = [
    ("bfloat16", {}),
    ("bfloat16", {"sliding_window": 128, "soft_cap": 30.0}),
    ("float32", {}),
]


@pytest.mark.parametrize(("dtype", "options"), LOWERING_OPTIONS)
def test_tpu_kernel_lowers_for_tpu(dtype, options):
    fn = functools.partial(kernel_tpu.ragged_paged_attention, sm_scale=128**-0.5, **options)
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shape_structs(DTYPES[dtype]))
    assert "tpu_custom_call" in exported.mlir_module()


@pytest.mark.parametrize(("dtype", "options"), LOWERING_OPTIONS)
def test_gpu_kernel_lowers_for_cuda(dtype, options):
    fn = functools.partial(kernel_gpu.ragged_paged_attention, sm_scale=128**-0.5, **options)
    # The Triton custom call has no export compatibility guarantee; allow it explicitly.
    triton_call = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[triton_call])(
        *shape_structs(DTYPES[dtype])
    )
    assert "__gpu$xla.gpu.triton" in exported.mlir_module()
