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
few columns per sequence).

Under tensor parallelism (a mesh with a "model" axis set around the step's tracing) each
kernel runs under `shard_map` on its own device's heads (`Op.heads` says how each argument and
output splits); an operation whose heads do not split evenly over the devices (KV heads fewer
than the devices, Mamba2 groups neither one nor a multiple of them) runs its reference over
the whole arrays instead, which XLA partitions itself.

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
from jax.sharding import PartitionSpec

from pallas_kernels.causal_conv1d import causal_conv1d_update, ragged_causal_conv1d
from pallas_kernels.gated_delta import gated_delta_update, ragged_gated_delta
from pallas_kernels.gated_delta import kernel_gpu as gated_delta_gpu
from pallas_kernels.gated_delta import kernel_tpu as gated_delta_tpu
from pallas_kernels.gated_delta.reference import GatedDeltaOutput
from pallas_kernels.ragged_paged_attention import kernel_gpu as attention_gpu
from pallas_kernels.ragged_paged_attention import kernel_tpu as attention_tpu
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv_pages
from pallas_kernels.selective_scan import kernel_gpu as selective_gpu
from pallas_kernels.selective_scan import kernel_tpu as selective_tpu
from pallas_kernels.selective_scan import ragged_selective_scan, selective_state_update
from pallas_kernels.selective_scan.reference import SelectiveScanOutput
from pallas_kernels.ssd import kernel_gpu as ssd_gpu
from pallas_kernels.ssd import kernel_tpu as ssd_tpu
from pallas_kernels.ssd import ragged_ssd_scan, ssd_state_update
from pallas_kernels.ssd.reference import RaggedScanOutput

MODEL = "model"  # the mesh axis tensor parallelism splits heads over (`engine/mesh.py`)
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


def _gpu_gated_delta_fits(q: jax.Array, k: jax.Array, v: jax.Array, *args, **kwargs) -> bool:
    key_dim = q.shape[-1]
    return key_dim % 8 == 0 and key_dim <= gated_delta_gpu.MAX_KEY_DIM and v.shape[-1] % gated_delta_gpu.SLICE == 0


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


# Per positional argument (and per output, in a NamedTuple of the op's outputs), the axis
# holding heads, split over the devices; None: every device takes all of it.
Axes = tuple[int | None, ...]
HeadSplit = Callable[..., tuple[Axes, Axes | int] | None]  # (tp, *args, **kwargs) -> axes, or None: cannot split


def _attention_heads(tp: int, q, k_pages, *args, **kwargs) -> tuple[Axes, int] | None:
    if q.shape[1] % tp or k_pages.shape[2] % tp:
        return None  # KV heads copied to every device
    return (1, 2, 2, None, None, None), 1


def _ssd_heads(tp: int, x, dt, A, B, *args, **kwargs) -> tuple[Axes, Axes] | None:
    groups = B.shape[1]
    if x.shape[1] % tp or (groups % tp and groups != 1):
        return None
    g = 1 if groups % tp == 0 else None  # one group: every device's heads read it
    return (1, 1, 0, g, g, 1, None, None), RaggedScanOutput(1, 1, 1, None, None)


def _gated_delta_heads(tp: int, q, k, v, *args, **kwargs) -> tuple[Axes, Axes] | None:
    if q.shape[1] % tp or v.shape[1] % tp:
        return None
    return (1, 1, 1, 1, 1, 1, None, None), GatedDeltaOutput(1, 1, 1, None, None)


def _selective_heads(tp: int, x, *args, **kwargs) -> tuple[Axes, Axes] | None:
    if x.shape[1] % tp:
        return None
    return (1, 1, 0, None, None, 1, None, None), SelectiveScanOutput(1, 1, 1, None, None)


@dataclasses.dataclass(frozen=True)
class Op:
    """One operation: its reference and, where written, its Pallas kernels (each taking
    `interpret=`), the test of the static shapes each kernel takes, and how a kernel's
    arguments split by head under tensor parallelism."""

    reference: Callable
    tpu: Callable | None = None
    gpu: Callable | None = None
    tpu_fits: Callable[..., bool] = _fits_always
    gpu_fits: Callable[..., bool] = _fits_always
    heads: HeadSplit | None = None


OPS: dict[str, Op] = {
    "ragged_paged_attention": Op(
        ragged_paged_attention,
        attention_tpu.ragged_paged_attention,
        attention_gpu.ragged_paged_attention,
        gpu_fits=_gpu_attention_fits,
        heads=_attention_heads,
    ),
    "write_kv_pages": Op(write_kv_pages),
    "ragged_ssd_scan": Op(
        reference_scan, ssd_tpu.ragged_ssd_scan, ssd_gpu.ragged_ssd_scan, _tpu_scan_fits, _gpu_scan_fits, _ssd_heads
    ),
    "ssd_state_update": Op(ssd_state_update),
    "ragged_causal_conv1d": Op(ragged_causal_conv1d),
    "causal_conv1d_update": Op(causal_conv1d_update),
    "ragged_gated_delta": Op(
        reference_gated_delta,
        gated_delta_tpu.ragged_gated_delta,
        gated_delta_gpu.ragged_gated_delta,
        _tpu_gated_delta_fits,
        _gpu_gated_delta_fits,
        _gated_delta_heads,
    ),
    "gated_delta_update": Op(gated_delta_update),
    "ragged_selective_scan": Op(
        reference_selective_scan,
        selective_tpu.ragged_selective_scan,
        selective_gpu.ragged_selective_scan,
        gpu_fits=_gpu_selective_fits,
        heads=_selective_heads,
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


def on_each_device(local: Callable, whole: Callable, heads: HeadSplit, tp: int) -> Callable:
    """`local` under `shard_map` over the current mesh's "model" axis, each device on its own
    heads as `heads` splits them; `whole` (a reference, which XLA partitions) where they do
    not split evenly."""

    def spec(axis: int | None) -> PartitionSpec:
        return PartitionSpec() if axis is None else PartitionSpec(*[None] * axis, MODEL)

    @functools.wraps(whole)
    def call(*args, **kwargs):
        axes = heads(tp, *args, **kwargs)
        if axes is None:
            return whole(*args, **kwargs)
        in_axes, out_axes = axes
        out_specs = type(out_axes)(*map(spec, out_axes)) if isinstance(out_axes, tuple) else spec(out_axes)
        fn = jax.shard_map(
            functools.partial(local, **kwargs), in_specs=tuple(map(spec, in_axes)), out_specs=out_specs, check_vma=False
        )
        return fn(*args)

    return call


def _mesh_model_size() -> int:
    """Devices on the "model" axis of the mesh set around the tracing (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or MODEL not in mesh.axis_names else mesh.shape[MODEL]


def _reference_row(chunk_size: int) -> int:
    return math.gcd(chunk_size, REFERENCE_SCAN_ROW)


def _whole_chunk(chunk_size: int) -> int:
    return chunk_size


def kernel_ops(name: str) -> KernelOps:
    """The kernel set called `name` (see the module docstring), for the default JAX backend
    and the mesh set around the tracing."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernels={name!r}; supported: {', '.join(KERNELS)}")
    backend = jax.default_backend()
    if name == "reference" or (name == "auto" and backend not in ("tpu", "gpu")):
        return KernelOps({n: op.reference for n, op in OPS.items()}, _reference_row)
    fns = {}
    if name.startswith("pallas-interpret-"):
        platform = name.removeprefix("pallas-interpret-")
        for n, op in OPS.items():
            kernel = getattr(op, platform)
            fns[n] = functools.partial(kernel, interpret=True) if kernel else op.reference
    elif backend not in ("tpu", "gpu"):
        raise ValueError(
            f"kernels='pallas' needs a TPU or GPU backend, this one is {backend!r}; use 'auto' or 'reference'"
        )
    else:
        for n, op in OPS.items():
            kernel, fits = getattr(op, backend), getattr(op, f"{backend}_fits")
            if kernel is None:
                fns[n] = op.reference
            elif name == "pallas":
                fns[n] = kernel
            else:
                fns[n] = _with_fallback(kernel, op.reference, fits)
    tp = _mesh_model_size()
    if tp > 1:
        fns = {
            n: on_each_device(fn, OPS[n].reference, OPS[n].heads, tp)
            if OPS[n].heads and fn is not OPS[n].reference
            else fn
            for n, fn in fns.items()
        }
    return KernelOps(fns, _whole_chunk)
