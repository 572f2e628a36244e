"""The depthwise causal conv1d of a recurrent mixer's mixed step, with its conv state and the
conv states its checkpoints save (Mamba2 and Gated DeltaNet both run one before their scan;
their decode steps use the one-token update instead, `token_steps.py`)."""

import jax

from jaxengine.models.batch import StepBatch, TokenLayout, states_at_requests
from jaxengine.models.kernels import KernelOps
from pallas_kernels.causal_conv1d import conv_states_after


def conv_step(
    ops: KernelOps,
    x: jax.Array,  # [T, C] raw inputs
    weight: jax.Array,  # [C, K]
    bias: jax.Array | None,  # [C]
    conv_in: jax.Array,  # [S, C, K]: each sequence's last K raw columns before this step
    batch: StepBatch,
    layout: TokenLayout,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns the conv output [T, C] (no activation), each sequence's conv state after this
    step [S, C, K], and the conv states at the step's checkpoint saves [C_saves, C, K] and
    draft positions [P, C, K] (`states_at_requests`)."""
    out, conv_out = ops.ragged_causal_conv1d(x, weight, bias, conv_in, batch.cu_q_lens)

    def states_at(seq, pos, window):  # consumed: tokens of this step before each requested state
        return conv_states_after(x, conv_in, batch.cu_q_lens, seq, pos - layout.start_pos[seq])

    return out, conv_out, *states_at_requests(states_at, batch, window=0)  # no scan rows: any window
