"""The acceptance rule on the host and inside the step give the same tokens: both against a
plain loop over the drafts (the rule as the speculative-decoding papers state it)."""

import types

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.engine.spec.acceptance import accept, last_accepted_rows
from tests.property_examples import examples


def _loop_accept(drafts: list[int], sampled: list[int]) -> list[int]:
    out = []
    for draft, target in zip(drafts, sampled):
        if draft != target:
            return out + [target]
        out.append(draft)
    return out + [sampled[len(drafts)]]


rows = st.lists(st.integers(0, 2), min_size=1, max_size=5)  # few token values: drafts often agree


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.tuples(rows, rows), min_size=1, max_size=4), st.integers(1, 5))
def test_host_and_step_keep_the_drafts_a_loop_keeps(pairs, k):
    width = k + 1
    seqs = []
    for drafts, sampled in pairs:
        drafts = drafts[:k]
        sampled = (sampled * width)[: len(drafts) + 1]
        seqs.append((drafts, sampled))
    # Each sequence's sample rows are its last `width` tokens of a flat batch; rows before its
    # pending token hold other tokens (padding here), which the step must not count as drafts.
    input_ids, sample_rows, num_drafts, sampled_rows = [], [], [], []
    for drafts, sampled in seqs:
        pad = width - 1 - len(drafts)
        start = len(input_ids)
        input_ids += [7] * pad + [9] + drafts  # padding, the pending token, its drafts
        sample_rows.append(list(range(start, start + width)))
        num_drafts.append(len(drafts))
        sampled_rows.append([8] * pad + sampled)  # the target's token after each row
    batch = types.SimpleNamespace(input_ids=jnp.array(input_ids, jnp.int32))
    last = last_accepted_rows(batch, jnp.array(sample_rows), jnp.array(num_drafts), jnp.array(sampled_rows, jnp.int32))
    for (drafts, sampled), row, n in zip(seqs, np.asarray(last), num_drafts):
        want = _loop_accept(drafts, sampled)
        assert accept(drafts, sampled) == want
        assert row == width - 1 - n + len(want) - 1  # the row of the last kept token
