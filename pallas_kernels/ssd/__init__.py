"""Mamba2 state-space duality (SSD): the ragged chunked scan and the one-token update."""

from pallas_kernels.ssd.reference import RaggedScanOutput, ragged_ssd_scan, ssd_state_update, ssd_states_at

__all__ = ["RaggedScanOutput", "ragged_ssd_scan", "ssd_state_update", "ssd_states_at"]
