"""A step's host-built inputs: what the builder fills per step, and what it does not.

A step's host work must not grow with context or with `max_model_len`: sequences' tokens and
pages are converted to arrays only as they grow (`list_mirror.Int32Mirror`), and inputs that
a step ignores (penalties' histories, grammar masks) are one read-only array the
runner keeps on the devices (`device_inputs.py`)."""

import dataclasses
import pickle

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.engine.batch_builder import BatchBuilder
from jaxengine.engine.device_inputs import MAX_KEPT_BYTES, DeviceInputs, ignored
from jaxengine.engine.list_mirror import Int32Mirror
from jaxengine.engine.padded_arrays import PaddedArrays
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence import Sequence
from tests.property_examples import examples

# Ops on a followed list: append some items, replace it by a new list, or cut it shorter in place.
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(st.integers(-5, 2**31 - 1), max_size=9)),
        st.tuples(st.just("replace"), st.lists(st.integers(0, 99), max_size=20)),
        st.tuples(st.just("cut"), st.integers(0, 30)),
    ),
    max_size=25,
)


@settings(max_examples=examples(200), deadline=None)
@given(_ops)
def test_a_mirror_equals_its_list_through_appends_replacements_and_cuts(ops):
    mirror, padded, items = Int32Mirror(), Int32Mirror(width=256), []
    for op, arg in ops:
        if op == "append":
            items.extend(arg)
        elif op == "replace":
            items = list(arg)
        else:
            del items[arg:]
        got = mirror.of(items)
        assert got.dtype == np.int32 and got.tolist() == items
        row = padded.of(items)  # a page table's row: the items, then zeros
        assert row.dtype == np.int32 and row.tolist() == items + [0] * (256 - len(items))


def test_a_mirror_of_a_fixed_width_refuses_a_longer_list():
    with pytest.raises(ValueError, match="width 3"):
        Int32Mirror(width=3).of([1, 2, 3, 4])


def _builder(**overrides) -> BatchBuilder:
    args = dict(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, page_size=4)
    return BatchBuilder(**{**args, **overrides}, eos_token_ids=(0,), vocab_size=100)


def _decoding(tokens: list[int], pages: list[int], params: SamplingParams) -> Sequence:
    """A sequence with all but its last token computed: its next step decodes that one."""
    seq = Sequence("r", 0, list(tokens), 3, params, seed=0)
    seq.num_computed, seq.pages = len(tokens) - 1, list(pages)
    return seq


def test_steps_without_penalties_share_one_ignored_history_and_others_fill_theirs():
    builder = _builder()
    plain = _decoding([5, 6, 7, 8, 9], [3, 4], SamplingParams())
    penalised = _decoding([5, 6, 7, 8, 9, 10], [7, 8], SamplingParams(repetition_penalty=1.2))
    _, first = builder.build(ScheduledStep([plain], [1]))
    plain.tokens.append(11)
    plain.num_computed += 1
    _, second = builder.build(ScheduledStep([plain], [1]))
    assert first.history is second.history and not first.history.flags.writeable
    assert first.grammar_mask is second.grammar_mask  # no grammar either
    batch, mixed = builder.build(ScheduledStep([plain, penalised], [1, 1]))
    assert mixed.history is not first.history
    assert mixed.history[0, :7].tolist() == [5, 6, 7, 8, 9, 11, -1]
    assert mixed.history[1, :6].tolist() == [5, 6, 7, 8, 9, 10] and mixed.history[1, 6] == -1
    assert np.asarray(batch.page_table)[:2, :2].tolist() == [[3, 4], [7, 8]]


def test_page_tables_follow_pages_added_and_replaced():
    builder = _builder()
    seq = _decoding([1, 2, 3, 4, 5], [9, 10], SamplingParams())
    tables = [np.asarray(builder.build(ScheduledStep([seq], [1]))[0].page_table)[0, :4].tolist()]
    seq.pages.extend([11, 12])
    tables.append(np.asarray(builder.build(ScheduledStep([seq], [1]))[0].page_table)[0, :4].tolist())
    seq.pages = [20]  # preempted and re-admitted elsewhere
    tables.append(np.asarray(builder.build(ScheduledStep([seq], [1]))[0].page_table)[0, :4].tolist())
    assert tables == [[9, 10, 0, 0], [9, 10, 11, 12], [20, 0, 0, 0]]


@dataclasses.dataclass(frozen=True)
class _Inputs:
    history: object
    lens: object


def test_ignored_arrays_become_one_device_copy_per_sharding():
    history = ignored((2, 5), -1)
    assert ignored((2, 5), -1) is history and ignored((2, 5), 0) is not history
    assert pickle.loads(pickle.dumps(history)) is history  # another process's own (`multihost.Lockstep`)
    view = pickle.loads(pickle.dumps(history[:1]))  # a view of one is a plain array
    assert type(view) is np.ndarray and view.tolist() == [[-1] * 5]
    copies = DeviceInputs()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    lens = np.array([3, 4], np.int32)
    first = copies.swap(_Inputs(history, lens), lambda: _Inputs(one, one))
    second = copies.swap(_Inputs(history, lens.copy()), lambda: _Inputs(one, one))
    assert isinstance(first.history, jax.Array) and first.history is second.history
    assert np.asarray(first.history).tolist() == [[-1] * 5] * 2
    assert first.lens is lens  # sent with its step the first time
    # Another executable may take it in another sharding: a copy of its own.
    named = jax.sharding.NamedSharding(jax.sharding.Mesh(jax.devices()[:1], ("x",)), jax.sharding.PartitionSpec())
    elsewhere = copies.swap(_Inputs(history, lens), lambda: _Inputs(named, named)).history
    assert elsewhere.sharding == named and elsewhere is not first.history and first.history.sharding == one
    dropped = copies.swap(_Inputs(history, lens), lambda: _Inputs(None, None)).history
    assert dropped is history  # an input the executable dropped (never read): nothing to copy
    copies.delete()
    assert first.history.is_deleted()
    again = copies.swap(_Inputs(history, lens), lambda: _Inputs(one, one))
    assert not again.history.is_deleted() and np.asarray(again.history).tolist() == [[-1] * 5] * 2


def test_inputs_unchanged_since_the_last_step_are_not_sent_again():
    copies = DeviceInputs()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    settings = np.array([0.5, 1.0], np.float32)

    def step(history, lens):
        swapped = copies.swap(_Inputs(history, lens), lambda: _Inputs(one, one))
        return swapped.history, swapped.lens

    sent = [step(settings.copy(), np.array([n, n + 1], np.int32)) for n in range(4)]
    # The settings: sent with the first step, copied at the second, that copy from then on.
    assert sent[0][0] is not None and not isinstance(sent[0][0], jax.Array)
    assert isinstance(sent[1][0], jax.Array) and sent[2][0] is sent[1][0] and sent[3][0] is sent[1][0]
    assert np.asarray(sent[3][0]).tolist() == [0.5, 1.0] and sent[1][0].sharding == one
    # The lengths change every step: each step gets its own host array.
    assert all(type(lens) is np.ndarray and lens.tolist() == [n, n + 1] for n, (_, lens) in enumerate(sent))
    changed, _ = step(np.array([0.5, 2.0], np.float32), np.zeros(2, np.int32))
    assert type(changed) is np.ndarray and changed.tolist() == [0.5, 2.0]  # new bytes: sent, never the old copy
    again, _ = step(np.array([0.5, 2.0], np.float32), np.zeros(2, np.int32))
    assert isinstance(again, jax.Array) and np.asarray(again).tolist() == [0.5, 2.0]
    # The same bytes in another shape or dtype are another input.
    reshaped, _ = step(np.array([[0.5, 2.0]], np.float32), np.zeros(2, np.int32))
    retyped, _ = step(np.array([0.5, 2.0], np.float32).view(np.int32), np.zeros(2, np.int32))
    assert type(reshaped) is np.ndarray and reshaped.shape == (1, 2)
    assert type(retyped) is np.ndarray and retyped.dtype == np.int32
    big = np.zeros(MAX_KEPT_BYTES // 4 + 1, np.int32)  # over the limit: always sent
    assert all(step(big, np.zeros(2, np.int32))[0] is big for _ in range(3))
    copies.delete()
    assert again.is_deleted()


def test_padded_arrays_are_fresh_each_time_and_hold_their_padding():
    padded = PaddedArrays(
        dict(ids=((3,), np.int32, 0), rows=((2, 2), np.int32, -1), top_p=((2,), np.float32, 1), on=((2,), bool, False))
    )
    first = padded.fresh()
    assert {k: (v.dtype, v.tolist()) for k, v in first.items()} == {
        "ids": (np.int32, [0, 0, 0]),
        "rows": (np.int32, [[-1, -1], [-1, -1]]),
        "top_p": (np.float32, [1.0, 1.0]),
        "on": (np.bool_, [False, False]),
    }
    for array in first.values():
        array[...] = 7  # a step's arrays filled: the next step's start from their padding
    second = padded.fresh()
    assert second["ids"].tolist() == [0, 0, 0] and second["rows"].tolist() == [[-1, -1], [-1, -1]]
    assert second["top_p"].tolist() == [1.0, 1.0] and first["rows"].tolist() == [[7, 7], [7, 7]]


def test_a_built_step_is_the_same_whichever_step_came_before():
    builder = _builder()
    plain = _decoding([5, 6, 7, 8, 9], [3, 4], SamplingParams(temperature=0.5, top_p=0.9, logit_bias={3: 1.0}))
    other = _decoding([1, 2, 3], [9], SamplingParams(min_tokens=4, allowed_token_ids=[1, 2]))
    alone = builder.build(ScheduledStep([plain], [1]))
    builder.build(ScheduledStep([other, plain], [1, 1]))
    again = builder.build(ScheduledStep([plain], [1]))
    for built, rebuilt in zip(alone, again):
        for field in dataclasses.fields(built):
            a, b = np.asarray(getattr(built, field.name)), np.asarray(getattr(rebuilt, field.name))
            assert a.dtype == b.dtype and a.tolist() == b.tolist(), field.name
    assert np.asarray(again[1].top_p).tolist() == [np.float32(0.9)]
    assert np.asarray(again[1].bias_ids)[0, 0] == 3 and np.asarray(again[1].allowed_ids)[0, 0] == -1


def test_settings_are_kept_while_the_sequences_stay_and_rebuilt_when_they_change():
    builder = _builder()
    hot = _decoding([5, 6, 7], [3], SamplingParams(temperature=0.5, top_k=500, logit_bias={4: 200.0}))
    cold = _decoding([1, 2], [8], SamplingParams(temperature=0.0, min_p=0.2, logprobs=2))
    cold.num_prompt_tokens = 1
    late = _decoding([9, 9, 9, 9], [5], SamplingParams(temperature=1.5, allowed_token_ids=[7, 8]))
    _, first = builder.build(ScheduledStep([hot, cold], [1, 1]))
    hot.tokens.append(11)
    hot.num_computed += 1
    _, steady = builder.build(ScheduledStep([hot, cold], [1, 1]))  # a decode step of the same sequences
    assert steady.temperature is first.temperature and steady.bias_ids is first.bias_ids
    assert not steady.temperature.flags.writeable  # shared by steps: never written again
    _, swapped = builder.build(ScheduledStep([cold, hot], [1, 1]))
    _, replaced = builder.build(ScheduledStep([cold, late], [1, 1]))
    assert swapped.temperature.tolist() == [0.0, 0.5, 0.0, 0.0]  # bucket 4: padding rows after
    assert replaced.temperature.tolist() == [0.0, 1.5, 0.0, 0.0]
    assert swapped.top_k.tolist() == [0, 100, 0, 0]  # above the vocabulary (100): no limit either
    assert swapped.bias_ids[1, :2].tolist() == [4, -1] and swapped.bias_values[1, 0] == 100  # clipped
    assert replaced.bias_ids[1, 0] == -1 and replaced.allowed_ids[1, :3].tolist() == [7, 8, -1]
    assert swapped.wants_logprobs.tolist() == [True, False, False, False]
    assert np.allclose(swapped.min_p, [0.2, 0, 0, 0]) and swapped.prompt_lens.tolist() == [1, 3, 0, 0]
