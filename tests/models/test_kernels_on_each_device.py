"""Under tensor parallelism each kernel runs under `shard_map` on its own device's heads
(`kernels.on_each_device`): run that way (with the reference standing in for the kernel),
every operation gives the reference's outputs over the whole arrays, and an operation whose
heads do not split evenly runs over the whole arrays instead."""

import functools
import inspect

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxengine.models import kernels
from pallas_kernels.gated_delta import ragged_gated_delta
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.selective_scan import ragged_selective_scan
from pallas_kernels.ssd import ragged_ssd_scan
from tests.pallas_kernels import test_gated_delta_reference as gated_delta
from tests.pallas_kernels import test_ragged_paged_attention_kernels as attention
from tests.pallas_kernels import test_selective_scan_reference as selective
from tests.pallas_kernels import test_ssd_reference as ssd

LENGTHS, STARTS = [9, 0, 3, 12], [0, 4, 7, 17]  # chunk 8: segments inside, across and at chunk edges


def _positional(fn, inputs: dict) -> tuple:
    """`inputs` keyed by `fn`'s argument names, in its argument order."""
    return tuple(inputs[name] for name in inspect.signature(fn).parameters if name in inputs)


def _not_split(*args, **kwargs):
    raise AssertionError("ran over the whole arrays although the heads split")


def _attention(kv_heads: int) -> tuple:
    case = attention.Case(
        q_lens=(3, 1, 0, 6),
        kv_lens=(7, 9, 4, 13),
        page_size=4,
        kv_heads=kv_heads,
        group=2,
        head_dim=64,
        dtype="float32",
        num_pad=2,
        sliding_window=None,
        soft_cap=None,
        blocks=0,
        seed=3,
    )
    arrays, _ = attention.make_inputs(case)
    return ragged_paged_attention, arrays, dict(sm_scale=0.125)


def _ssd(groups: int) -> tuple:
    inputs = ssd.make_inputs(np.random.default_rng(1), LENGTHS, STARTS, groups, num_pad=3)
    return ragged_ssd_scan, _positional(ragged_ssd_scan, inputs), dict(chunk_size=8)


def _gated_delta() -> tuple:
    inputs = gated_delta.make_inputs(np.random.default_rng(2), LENGTHS, STARTS, 2, 2, 3, np.float32)
    return ragged_gated_delta, _positional(ragged_gated_delta, inputs), dict(chunk_size=8, scale=0.35)


def _selective() -> tuple:
    inputs = selective.make_inputs(np.random.default_rng(3), LENGTHS, STARTS, 3, np.float32, channels=8, state=4)
    return ragged_selective_scan, _positional(ragged_selective_scan, inputs), dict(chunk_size=8)


CASES = {  # name: (operation, inputs, tensor-parallel sizes whose heads split)
    "attention": ("ragged_paged_attention", functools.partial(_attention, 2), (2,)),
    "ssd one group": ("ragged_ssd_scan", functools.partial(_ssd, 1), (4,)),
    "ssd two groups": ("ragged_ssd_scan", functools.partial(_ssd, 2), (2,)),
    "gated delta": ("ragged_gated_delta", _gated_delta, (2,)),
    "selective scan": ("ragged_selective_scan", _selective, (8,)),
}


def _run(name: str, tp: int, whole) -> tuple:
    op, make, _ = CASES[name]
    fn, args, options = make()
    mesh = Mesh(np.array(jax.devices()[:tp]).reshape(1, tp), ("data", "model"))
    wrapped = kernels.on_each_device(fn, whole, kernels.OPS[op].heads, tp)
    with jax.set_mesh(mesh):
        got = jax.jit(functools.partial(wrapped, **options))(*args)
    return got, fn(*args, **options)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_device_on_its_heads_gives_the_whole_arrays_outputs(name):
    for tp in CASES[name][2]:
        got, want = _run(name, tp, _not_split)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=f"{name} tp={tp}")


@pytest.mark.parametrize(("name", "tp"), [("ssd two groups", 4), ("gated delta", 4)])
def test_heads_that_do_not_split_evenly_run_over_the_whole_arrays(name, tp):
    calls = []

    def whole(*args, **kwargs):
        calls.append(1)
        return CASES[name][1]()[0](*args, **kwargs)

    _run(name, tp, whole)
    assert calls


def test_kv_heads_fewer_than_the_devices_run_over_the_whole_arrays():
    fn, args, options = _attention(1)
    assert kernels.OPS["ragged_paged_attention"].heads(2, *args, **options) is None
