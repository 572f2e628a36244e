"""The one switch point between the model and its kernels: a registry of operations.

Each operation (`OPS`) has a pure-jnp reference in `pallas_kernels` and, where written, Pallas
kernels for TPU and GPU with the reference's signature, and a test of the (static) shapes
each kernel takes. A mixer calls operations by name (`ops.ragged_ssd_scan(...)`); adding a
kernel is an entry here.

  kernels="auto"                  Pallas kernels on TPU and GPU (where the shapes suit them),
                                  the references on CPU
  kernels="reference"             the pure-jnp references everywhere (the fallback if a
                                  kernel misbehaves on some hardware)
  kernels="pallas"                the current backend's Pallas kernels, no fallback
  kernels="pallas-interpret-tpu"  the TPU kernels in the TPU interpreter (any machine; slow)
  kernels="pallas-interpret-gpu"  the GPU kernels in the Pallas interpreter (any machine; slow)

Operations without a kernel use their reference under every setting: the causal conv1d and
the one-token SSD, gated-delta and selective-scan updates (XLA fuses them well: they move a
few columns per sequence), and on GPU, for now, the chunked gated-delta scan (it has a TPU
kernel only).

The reference scans run on a grid of short rows (`REFERENCE_SCAN_ROW` tokens, or the chunk
size if smaller) rather than whole chunks. Any divisor of the chunk size gives the same
outputs and the same states at chunk boundaries (they are among the rows' end states), but
on a CPU short rows cost far less: the quadratic intra-row work shrinks with the row, and a
decoding sequence inside a mixed step fills one short row instead of a whole chunk.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax

from pallas_kernels.causal_conv1d import causal_conv1d_update, ragged_causal_conv1d
from pallas_kernels.gated_delta import gated_delta_update, ragged_gated_delta
from pallas_kernels.gated_delta import kernel_tpu as gated_delta_tpu
from pallas_kernels.ragged_paged_attention import kernel_gpu as attention_gpu
from pallas_kernels.ragged_paged_attention import kernel_tpu as attention_tpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv_pages
from pallas_kernels.selective_scan import kernel_gpu as selective_gpu
from pallas_kernels.selective_scan import kernel_tpu as selective_tpu
from pallas_kernels.selective_scan import ragged_selective_scan, selective_state_update
from pallas_kernels.ssd import kernel_gpu as ssd_gpu
from pallas_kernels.ssd import kernel_tpu as ssd_tpu
from pallas_kernels.ssd import ragged_ssd_scan, ssd_state_update

REFERENCE_SCAN_ROW = 16  # tokens per row of the reference scan's grid (measured best on CPU)
KERNELS = ("auto", "reference", "pallas", "pallas-interpret-tpu", "pallas-interpret-gpu")


def _gpu_attention_fits(q: jax.Array, *args, **kwargs) -> bool:
    head_dim = q.shape[-1]
    return head_dim & (head_dim - 1) == 0


def _gpu_scan_fits(x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, *args, **kwargs) -> bool:
    state = B.shape[-1]
    return x.shape[-1] % 64 == 0 and state % 16 == 0 and state <= 128 and x.dtype == B.dtype


def _tpu_scan_fits(*args, chunk_size: int, **kwargs) -> bool:
    return chunk_size % 128 == 0


def _tpu_gated_delta_fits(q: jax.Array, k: jax.Array, v: jax.Array, *args, chunk_size: int, **kwargs) -> bool:
    return q.shape[-1] % 128 == 0 and v.shape[-1] % 128 == 0 and chunk_size % 8 == 0


@functools.wraps(ragged_ssd_scan)
def reference_scan(*args, chunk_size: int, **kwargs):
    """The reference scan on rows of gcd(chunk_size, REFERENCE_SCAN_ROW) tokens."""
    return ragged_ssd_scan(*args, chunk_size=_reference_row(chunk_size), **kwargs)


@functools.wraps(ragged_selective_scan)
def reference_selective_scan(*args, chunk_size: int, **kwargs):
    """The reference selective scan on rows of gcd(chunk_size, REFERENCE_SCAN_ROW) tokens."""
    return ragged_selective_scan(*args, chunk_size=_reference_row(chunk_size), **kwargs)


@functools.wraps(ragged_gated_delta)
def reference_gated_delta(*args, chunk_size: int, **kwargs):
    """The reference gated-delta scan on rows of gcd(chunk_size, REFERENCE_SCAN_ROW) tokens."""
    return ragged_gated_delta(*args, chunk_size=_reference_row(chunk_size), **kwargs)


def _gpu_selective_fits(x: jax.Array, dt: jax.Array, A: jax.Array, *args, **kwargs) -> bool:
    return x.shape[-1] % selective_gpu.CHANNELS == 0 and A.shape[-1] % 8 == 0


def _fits_always(*args, **kwargs) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: its reference and, where written, its Pallas kernels (each taking
    `interpret=`) and the test of the static shapes each kernel takes."""

    reference: Callable
    tpu: Callable | None = None
    gpu: Callable | None = None
    tpu_fits: Callable[..., bool] = _fits_always
    gpu_fits: Callable[..., bool] = _fits_always


OPS: dict[str, Op] = {
    "ragged_paged_attention": Op(
        ragged_paged_attention, attention_tpu.ragged_paged_attention, attention_gpu.ragged_paged_attention,
        gpu_fits=_gpu_attention_fits,
    ),
    "write_kv_pages": Op(write_kv_pages),
    "ragged_ssd_scan": Op(reference_scan, ssd_tpu.ragged_ssd_scan, ssd_gpu.ragged_ssd_scan, _tpu_scan_fits, _gpu_scan_fits),
    "ssd_state_update": Op(ssd_state_update),
    "ragged_causal_conv1d": Op(ragged_causal_conv1d),
    "causal_conv1d_update": Op(causal_conv1d_update),
    "ragged_gated_delta": Op(reference_gated_delta, gated_delta_tpu.ragged_gated_delta, tpu_fits=_tpu_gated_delta_fits),
    "gated_delta_update": Op(gated_delta_update),
    "ragged_selective_scan": Op(
        reference_selective_scan, selective_tpu.ragged_selective_scan, selective_gpu.ragged_selective_scan,
        gpu_fits=_gpu_selective_fits,
    ),
    "selective_state_update": Op(selective_state_update),
}


class KernelOps:
    """The functions of one kernel setting, as attributes named after `OPS`, and
    `scan_row(chunk_size)`: the most tokens a row of the chunked scans' grid holds."""

    def __init__(self, fns: dict[str, Callable], scan_row: Callable[[int], int]):
        self._fns = fns
        self.scan_row = scan_row

    def __getattr__(self, name: str) -> Callable:
        fns = self.__dict__.get("_fns", {})
        if name not in fns:
            raise AttributeError(f"no kernel operation {name!r}; known: {', '.join(fns)}")
        return fns[name]


def _with_fallback(kernel: Callable, reference: Callable, fits: Callable[..., bool]) -> Callable:
    """`kernel` where `fits` says the (static) shapes suit it, else `reference`."""

    @functools.wraps(reference)
    def call(*args, **kwargs):
        return (kernel if fits(*args, **kwargs) else reference)(*args, **kwargs)

    return call


def _reference_row(chunk_size: int) -> int:
    return math.gcd(chunk_size, REFERENCE_SCAN_ROW)


def _whole_chunk(chunk_size: int) -> int:
    return chunk_size


def kernel_ops(name: str) -> KernelOps:
    """The kernel set called `name` (see the module docstring), for the default JAX backend."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels={name!r}; supported: {', '.join(KERNELS)}")
    backend = jax.default_backend()
    if name == "reference" or (name == "auto" and backend not in ("tpu", "gpu")):
        return KernelOps({n: op.reference for n, op in OPS.items()}, _reference_row)
    if name.startswith("pallas-interpret-"):
        platform = name.removeprefix("pallas-interpret-")
        fns = {}
        for n, op in OPS.items():
            kernel = getattr(op, platform)
            fns[n] = functools.partial(kernel, interpret=True) if kernel else op.reference
        return KernelOps(fns, _whole_chunk)
    if backend not in ("tpu", "gpu"):
        raise ValueError(f"kernels='pallas' needs a TPU or GPU backend, this one is {backend!r}; use 'auto' or 'reference'")
    fns = {}
    for n, op in OPS.items():
        kernel, fits = getattr(op, backend), getattr(op, f"{backend}_fits")
        if kernel is None:
            fns[n] = op.reference
        elif name == "pallas":
            fns[n] = kernel
        else:
            fns[n] = _with_fallback(kernel, op.reference, fits)
    return KernelOps(fns, _whole_chunk)
