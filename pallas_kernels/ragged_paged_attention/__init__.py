"""Ragged paged attention: one call attends a whole mixed prefill/decode batch."""

from pallas_kernels.ragged_paged_attention.reference import (
    ragged_paged_attention,
    validate_inputs,
    write_kv_pages,
)

__all__ = ["ragged_paged_attention", "validate_inputs", "write_kv_pages"]
