"""The Mamba-1 selective scan: the ragged chunked scan, the one-token update and states at
any position."""

from pallas_kernels.selective_scan.reference import (
    SelectiveScanOutput,
    ragged_selective_scan,
    selective_state_update,
    selective_states_at,
)

__all__ = ["SelectiveScanOutput", "ragged_selective_scan", "selective_state_update", "selective_states_at"]
