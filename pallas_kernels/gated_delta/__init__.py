"""The gated delta rule (Gated DeltaNet): the ragged chunked scan, the one-token update and
states at any position."""

from pallas_kernels.gated_delta.reference import (
    GatedDeltaOutput,
    gated_delta_states_at,
    gated_delta_update,
    ragged_gated_delta,
)

__all__ = ["GatedDeltaOutput", "gated_delta_states_at", "gated_delta_update", "ragged_gated_delta"]
