"""The one switch point between the model and its attention and SSM kernels.

Every implementation has the signatures of the pure-jnp references in `pallas_kernels`.

  kernels="auto"                  Pallas kernels on TPU and GPU (where the shapes suit them),
                                  the references on CPU
  kernels="reference"             the pure-jnp references everywhere (the fallback if a
                                  kernel misbehaves on some hardware)
  kernels="pallas"                the current backend's Pallas kernels, no fallback
  kernels="pallas-interpret-tpu"  the TPU kernels in the TPU interpreter (any machine; slow)
  kernels="pallas-interpret-gpu"  the GPU kernels in the Pallas interpreter (any machine; slow)

Only ragged paged attention and the ragged SSD scan have kernels; the causal conv1d and
the one-token SSD update always use the references (XLA fuses them well: they move a few
columns per sequence).

The reference scan runs on a grid of short rows (`REFERENCE_SCAN_ROW` tokens, or the chunk
size if smaller) rather than whole chunks. Any divisor of the chunk size gives the same
outputs and the same states at chunk boundaries (they are among the rows' end states), but
on a CPU short rows cost far less: the quadratic intra-row work shrinks with the row, and a
decoding sequence inside a mixed step fills one short row instead of a whole chunk.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax

from pallas_kernels.causal_conv1d import causal_conv1d_update, ragged_causal_conv1d
from pallas_kernels.ragged_paged_attention import kernel_gpu as attention_gpu
from pallas_kernels.ragged_paged_attention import kernel_tpu as attention_tpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv_pages
from pallas_kernels.ssd import kernel_gpu as ssd_gpu
from pallas_kernels.ssd import kernel_tpu as ssd_tpu
from pallas_kernels.ssd import ragged_ssd_scan, ssd_state_update

REFERENCE_SCAN_ROW = 16  # tokens per row of the reference scan's grid (measured best on CPU)
KERNELS = ("auto", "reference", "pallas", "pallas-interpret-tpu", "pallas-interpret-gpu")


class KernelOps(NamedTuple):
    """The functions a model step calls for its attention and Mamba layers."""

    ragged_paged_attention: Callable
    write_kv_pages: Callable
    ragged_ssd_scan: Callable
    ssd_state_update: Callable
    ragged_causal_conv1d: Callable
    causal_conv1d_update: Callable
    scan_row: Callable[[int], int]  # chunk size -> the most tokens a row of the scan's grid holds


def _gpu_attention_fits(q: jax.Array, *args, **kwargs) -> bool:
    head_dim = q.shape[-1]
    return head_dim & (head_dim - 1) == 0


def _gpu_scan_fits(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, *args, **kwargs) -> bool:
    state = B.shape[-1]
    return x.shape[-1] % 64 == 0 and state % 16 == 0 and state <= 128 and x.dtype == B.dtype


def _tpu_scan_fits(*args, chunk_size: int, **kwargs) -> bool:
    return chunk_size % 128 == 0


@functools.wraps(ragged_ssd_scan)
def reference_scan(*args, chunk_size: int, **kwargs):
    """The reference scan on rows of gcd(chunk_size, REFERENCE_SCAN_ROW) tokens."""
    return ragged_ssd_scan(*args, chunk_size=_reference_row(chunk_size), **kwargs)


def _with_fallback(kernel: Callable, reference: Callable, fits: Callable[..., bool]) -> Callable:
    """`kernel` where `fits` says the (static) shapes suit it, else `reference`."""

    @functools.wraps(reference)
    def call(*args, **kwargs):
        return (kernel if fits(*args, **kwargs) else reference)(*args, **kwargs)

    return call


def _reference_row(chunk_size: int) -> int:
    return math.gcd(chunk_size, REFERENCE_SCAN_ROW)


def _ops(attention: Callable, scan: Callable, scan_row: Callable[[int], int] = lambda chunk: chunk) -> KernelOps:
    return KernelOps(
        attention, write_kv_pages, scan, ssd_state_update, ragged_causal_conv1d, causal_conv1d_update, scan_row
    )


def kernel_ops(name: str) -> KernelOps:
    """The kernel set called `name` (see the module docstring), for the default JAX backend."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels={name!r}; supported: {', '.join(KERNELS)}")
    backend = jax.default_backend()
    if name == "reference" or (name == "auto" and backend not in ("tpu", "gpu")):
        return _ops(ragged_paged_attention, reference_scan, _reference_row)
    if name == "pallas-interpret-tpu":
        interp = dict(interpret=True)
        return _ops(
            functools.partial(attention_tpu.ragged_paged_attention, **interp),
            functools.partial(ssd_tpu.ragged_ssd_scan, **interp),
        )
    if name == "pallas-interpret-gpu":
        interp = dict(interpret=True)
        return _ops(
            functools.partial(attention_gpu.ragged_paged_attention, **interp),
            functools.partial(ssd_gpu.ragged_ssd_scan, **interp),
        )
    if backend == "tpu":
        attention, scan = attention_tpu.ragged_paged_attention, ssd_tpu.ragged_ssd_scan
        scan_fits = _tpu_scan_fits
        attention_fits: Callable[..., bool] = lambda *a, **k: True  # noqa: E731
    elif backend == "gpu":
        attention, scan = attention_gpu.ragged_paged_attention, ssd_gpu.ragged_ssd_scan
        scan_fits, attention_fits = _gpu_scan_fits, _gpu_attention_fits
    else:
        raise ValueError(f"kernels='pallas' needs a TPU or GPU backend, this one is {backend!r}; use 'auto' or 'reference'")
    if name == "pallas":
        return _ops(attention, scan)
    return _ops(
        _with_fallback(attention, ragged_paged_attention, attention_fits),
        _with_fallback(scan, reference_scan, scan_fits),
    )
