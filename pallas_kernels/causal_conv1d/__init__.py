"""Depthwise causal conv1d with a carried state, over a ragged batch or one token."""

from pallas_kernels.causal_conv1d.reference import causal_conv1d_update, conv_states_after, ragged_causal_conv1d

__all__ = ["causal_conv1d_update", "conv_states_after", "ragged_causal_conv1d"]
