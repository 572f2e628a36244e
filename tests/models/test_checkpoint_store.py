"""Checkpoints in cache blocks: every layer's state comes back (bit for bit in a float32
store, to 16 significant bits in a bfloat16 one), and layers and checkpoints never overlap
each other or the pages around them."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxengine.engine.pools import store_layout
from jaxengine.models.arch import load_model_config
from jaxengine.models.checkpoint_store import checkpoint_layout
from jaxengine.models.mixer_state import StateArray
from tests.models.tiny_models import save_tiny_model


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h", "mamba2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_states_round_trip(tmp_path, arch, dtype):
    save_tiny_model(arch, tmp_path)
    cfg = load_model_config(tmp_path)
    layout = store_layout(cfg, 4, dtype)
    m = cfg.mamba
    nb = layout.blocks_per_checkpoint
    num_blocks = 1 + 3 * nb + 2
    unit = layout.unit_shape
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.standard_normal((num_blocks, *unit)), dtype) for _ in range(layout.num_arrays)]
    before = [np.asarray(a) for a in arrays]
    # Three checkpoints in shuffled blocks; SSM states over many magnitudes, as states get.
    order = rng.permutation(np.arange(1, num_blocks))
    blocks = jnp.asarray(order[: 3 * nb].reshape(3, nb), jnp.int32)
    shape = (3, m.num_heads, m.head_dim, m.state_size)
    conv = [jnp.asarray(rng.standard_normal((3, m.conv_dim, m.conv_kernel)), dtype) for _ in layout.layers]
    ssm = [
        rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-20, 20, shape)).astype(np.float32)
        for _ in layout.layers
    ]
    for j in range(len(layout.layers)):
        layout.write(arrays, blocks, j, (conv[j], jnp.asarray(ssm[j])))
    for j in range(len(layout.layers)):
        got_conv, got_ssm = layout.read(arrays, blocks, j)
        assert np.array_equal(np.asarray(got_conv), np.asarray(conv[j]))
        if dtype == jnp.float32:
            assert np.array_equal(np.asarray(got_ssm), ssm[j])
        else:
            assert np.all(np.abs(np.asarray(got_ssm) - ssm[j]) <= 2.0**-16 * np.abs(ssm[j]))
    # Blocks outside the three checkpoints are untouched.
    untouched = order[3 * nb :]
    for a, b in zip(arrays, before):
        assert np.array_equal(np.asarray(a)[untouched], b[untouched])
        assert np.array_equal(np.asarray(a)[0], b[0])


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h", "mamba2"])
def test_pieces_tile_the_checkpoint_without_overlap(tmp_path, arch):
    save_tiny_model(arch, tmp_path)
    layout = store_layout(load_model_config(tmp_path), 4, jnp.bfloat16)
    cells = [(p.array, p.first_block + k) for layer in layout.layers for p in layer.pieces for k in range(p.num_units)]
    assert len(cells) == len(set(cells))
    assert all(0 <= b < layout.blocks_per_checkpoint and 0 <= a < layout.num_arrays for a, b in cells)
    # Spread evenly: no more blocks than the units need, rounded up per array.
    assert layout.blocks_per_checkpoint <= -(-len(cells) // layout.num_arrays) + len(layout.layers)


@pytest.mark.parametrize("num_layers, num_arrays", [(6, 4), (24, 8), (1, 8), (2, 2), (5, 3)])
def test_layers_spread_evenly_over_the_arrays(num_layers, num_arrays):
    """A checkpoint takes the blocks its units need, rounded up over the arrays: layers are
    split where whole layers would leave arrays unevenly filled (each test layer is 3 units)."""

    layer = (StateArray("conv", (16, 4), False, 0), StateArray("ssm", (4, 4, 8), True, 0))  # 64 + 128 elements
    layout = checkpoint_layout([layer] * num_layers, (64,), jnp.float32, num_arrays)
    units = 3 * num_layers
    assert layout.blocks_per_checkpoint == -(-units // num_arrays)
