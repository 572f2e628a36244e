"""The donated pools are updated in place: no compiled step copies a whole pool.

A copy is easy to introduce without noticing (XLA inserts one whenever a read of a pool may
run after its in-place scatter), and it costs a full pass over every pool on every step,
which on a real model is more than the forward pass itself at small batch sizes.
"""

import re

import jax
import pytest

# An HLO instruction: `%name = f32[97,6,64,64]{3,2,1,0} opcode(`.
_INSTRUCTION = re.compile(r"= [a-z0-9]+\[([\d,]*)\]\{[^}]*\} ([a-z-]+)\(")


def _ops_on_pool_shapes(hlo: str, pool_shapes: set[tuple[int, ...]]) -> list[str]:
    """The opcodes of every instruction in `hlo` whose result has one of the pools' shapes."""
    ops = []
    for match in _INSTRUCTION.finditer(hlo):
        dims = tuple(int(d) for d in match.group(1).split(",") if d)
        if dims in pool_shapes:
            ops.append(match.group(2))
    return ops


def assert_no_step_copies_a_pool(engine, decode: bool, num_seqs: tuple[int, ...] = (1, 4)) -> None:
    """Compiles the step of one sequence (where XLA turns the slot gather into a dynamic slice)
    and of four (with the MTP module or draft model where the engine has one), and looks for
    copies among the instructions of the pools' shapes."""
    runner = engine.runner
    pools = jax.tree.leaves((runner.pools, runner.draft_pools))  # a draft model's too
    # The compiled step works on each device's shard (all of a pool on one device).
    pool_shapes = {tuple(p.sharding.shard_shape(p.shape)) for p in pools}
    shapes = [
        min(
            (s for s in engine.shapes() if s.decode == decode and s.num_seqs == n),
            key=lambda s: (s.num_tokens, not s.runs_drafter),
        )
        for n in num_seqs
    ]
    for shape in shapes:
        batch, sampling = engine.builder.empty(shape)
        hlo = runner._lower(batch, sampling, shape.decode).compile().as_text()
        ops = _ops_on_pool_shapes(hlo, pool_shapes)
        # The parser sees the pools: each comes in as a parameter.
        assert ops.count("parameter") >= len(pools), (shape, ops)
        assert "copy" not in ops, f"{shape}: the step copies a whole pool ({ops.count('copy')} copies)"


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_no_step_copies_a_pool(bamba_llm, decode):
    assert_no_step_copies_a_pool(bamba_llm.engine, decode)
