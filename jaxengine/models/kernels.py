"""The one switch point between the model and its attention/SSM kernels.

Every implementation has the signatures of the pure-jnp references in `pallas_kernels`.
Only the references exist so far; Pallas kernels for TPU and GPU plug in here.
"""

from collections.abc import Callable
from typing import NamedTuple

from pallas_kernels.causal_conv1d import causal_conv1d_update, ragged_causal_conv1d
from pallas_kernels.ragged_paged_attention import ragged_paged_attention, write_kv_pages
from pallas_kernels.ssd import ragged_ssd_scan, ssd_state_update


class KernelOps(NamedTuple):
    """The functions a model step calls for its attention and Mamba layers."""

    ragged_paged_attention: Callable
    write_kv_pages: Callable
    ragged_ssd_scan: Callable
    ssd_state_update: Callable
    ragged_causal_conv1d: Callable
    causal_conv1d_update: Callable


_IMPLEMENTATIONS = {
    "reference": KernelOps(
        ragged_paged_attention=ragged_paged_attention,
        write_kv_pages=write_kv_pages,
        ragged_ssd_scan=ragged_ssd_scan,
        ssd_state_update=ssd_state_update,
        ragged_causal_conv1d=ragged_causal_conv1d,
        causal_conv1d_update=causal_conv1d_update,
    ),
}


def kernel_ops(name: str) -> KernelOps:
    """Returns the kernel set called `name` ("reference")."""
    if name not in _IMPLEMENTATIONS:
        raise ValueError(f"unknown kernels={name!r}; supported: {', '.join(_IMPLEMENTATIONS)}")
    return _IMPLEMENTATIONS[name]
