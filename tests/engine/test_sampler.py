"""The on-device sampler against hand-computed expectations on small vocabularies."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine.engine import sampler
from jaxengine.engine.sampler import SamplingBatch
from tests.property_examples import examples

_sample = jax.jit(sampler.sample_tokens, static_argnames="num_logprobs")


def sample_tokens(logits, sb, num_logprobs):
    """One sample row per sequence (a plain step): the outputs without the row axis."""
    return jax.tree.map(lambda a: a[:, 0], _sample(logits, sb, num_logprobs=num_logprobs))


VOCAB = 8


def _batch(n: int, **overrides) -> SamplingBatch:
    """A batch of `n` greedy rows with no filters, penalties or history, then `overrides`."""
    fields = dict(
        temperature=np.zeros(n, np.float32),
        top_k=np.zeros(n, np.int32),
        top_p=np.ones(n, np.float32),
        min_p=np.zeros(n, np.float32),
        presence_penalty=np.zeros(n, np.float32),
        frequency_penalty=np.zeros(n, np.float32),
        repetition_penalty=np.ones(n, np.float32),
        seeds=np.arange(n, dtype=np.uint32),
        steps=np.zeros(n, np.int32),
        history=np.full((n, 6), -1, np.int32),
        history_lens=np.full(n, 6, np.int32),
        prompt_lens=np.zeros(n, np.int32),
        banned=np.full((n, 4), -1, np.int32),
        min_tokens=np.zeros(n, np.int32),
        wants_logprobs=np.ones(n, bool),
        bias_ids=np.full((n, 3), -1, np.int32),
        bias_values=np.zeros((n, 3), np.float32),
        allowed_ids=np.full((n, 3), -1, np.int32),
        bad_ids=np.full((n, 2), -1, np.int32),
        grammar_mask=np.zeros((n, 1), np.int32),  # VOCAB = 8 tokens: one 32-bit word
        constrained=np.zeros(n, bool),
        sample_rows=np.arange(n, dtype=np.int32)[:, None],
        num_drafts=np.zeros(n, np.int32),
        next_ids=np.full(n, -1, np.int32),
        following_ids=np.full(n, -1, np.int32),
        wants_drafts=np.zeros(n, bool),
        speculates=np.zeros(n, bool),
        feed_rows=np.full(n, -1, np.int32),
        history_feed=np.full(n, -1, np.int32),
        history_ends=np.full(n, -1, np.int32),
    )
    for key, value in overrides.items():
        fields[key] = np.asarray(value, dtype=fields[key].dtype)
    return SamplingBatch(**fields)


def test_a_grammar_mask_keeps_only_its_tokens_and_its_rows():
    logits = np.random.default_rng(1).normal(size=(3, VOCAB)).astype(np.float32)
    mask = [[(1 << 2) | (1 << 5)], [(1 << 2) | (1 << 5)], [1 << 7]]  # tokens {2, 5}, {2, 5}, {7}
    sb = _batch(3, grammar_mask=mask, constrained=[True, False, True])
    out = sample_tokens(logits, sb, num_logprobs=2)
    tokens = np.asarray(out.tokens)
    assert tokens[0] == [2, 5][int(np.argmax(logits[0, [2, 5]]))]
    assert tokens[1] == int(np.argmax(logits[1]))  # not constrained: its mask row is ignored
    assert tokens[2] == 7
    allowed = logits[0, [2, 5]]
    want = logits[0, tokens[0]] - np.log(np.sum(np.exp(allowed)))
    assert float(np.asarray(out.logprob)[0]) == pytest.approx(want, abs=1e-5)  # of the masked distribution


LOGITS = np.log(np.array([[0.05, 0.4, 0.3, 0.1, 0.05, 0.04, 0.03, 0.03]], np.float32))


def _draws(logits: np.ndarray, n: int = 400, **settings) -> np.ndarray:
    """Tokens drawn from `n` identical rows with different seeds."""
    rows = np.repeat(logits, n, axis=0)
    sb = _batch(n, temperature=np.ones(n), **{k: np.full(n, v) for k, v in settings.items()})
    return np.asarray(sample_tokens(rows, sb, num_logprobs=2).tokens)


def test_greedy_picks_argmax_and_logprobs_are_raw_log_softmax():
    logits = np.random.default_rng(0).normal(size=(3, VOCAB)).astype(np.float32)
    out = sample_tokens(logits, _batch(3), num_logprobs=3)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    shifted = logits - logits.max(-1, keepdims=True)
    expected = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprob, expected.max(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out.top_ids, np.argsort(-logits, axis=-1)[:, :3])
    np.testing.assert_allclose(out.top_logprobs, np.sort(expected, axis=-1)[:, ::-1][:, :3], rtol=1e-5, atol=1e-6)


def test_top_k_limits_draws_to_the_k_most_likely():
    assert set(_draws(LOGITS, top_k=2)) <= {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # sorted probabilities 0.4, 0.3, 0.1, ...: p = 0.6 needs tokens 1 and 2, never 3
    drawn = _draws(LOGITS, top_p=0.6)
    assert set(drawn) == {1, 2}


def _kept_reference(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """vLLM's filters written out over a sorted row in float64: top-k keeps the k largest
    (ties with the k-th too), top-p the smallest run of them from the top whose mass reaches
    p (a token stays while the mass strictly above it is below p; ties together), min-p
    those with at least min_p times the largest probability among the rest."""
    x = logits.astype(np.float64)
    if top_k > 0:
        x = np.where(x >= np.sort(x)[::-1][min(top_k, len(x)) - 1], x, -np.inf)
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    if top_p < 1:
        above = np.array([probs[x > v].sum() for v in x])
        x = np.where(above < top_p, x, -np.inf)
    probs = np.exp(x - x.max()) / np.exp(x - x.max()).sum()
    return (probs >= min_p * probs.max()) & np.isfinite(x)


def test_filters_keep_what_sorting_the_row_keeps():
    """Top-k, top-p and min-p on rows of 300 logits with many ties (a grid of 0.25) and
    settings drawn at random, against the written-out rule above."""
    rng = np.random.default_rng(3)
    rows = 64
    logits = (np.round(rng.normal(size=(rows, 300)) * 8) / 4).astype(np.float32)
    logits[0, :] = 1.0  # all tied
    top_k = rng.choice([0, 1, 5, 40, 299, 300, 1000], rows).astype(np.int32)
    top_p = rng.choice([1.0, 0.05, 0.3, 0.7, 0.95, 0.999], rows).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], rows).astype(np.float32)
    sb = _batch(rows, temperature=np.ones(rows), top_k=top_k, top_p=top_p, min_p=min_p)
    kept = np.isfinite(np.asarray(jax.jit(sampler._filter)(logits, sb)))
    for i in range(rows):
        expected = _kept_reference(logits[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        np.testing.assert_array_equal(kept[i], expected, err_msg=f"row {i}: {top_k[i]=} {top_p[i]=} {min_p[i]=}")


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    # threshold 0.2 * 0.4 = 0.08 keeps tokens with p >= 0.08: 1, 2 and 3
    assert set(_draws(LOGITS, min_p=0.2)) == {1, 2, 3}


def test_unfiltered_draws_follow_the_distribution():
    drawn = _draws(LOGITS, n=4000)
    freq = np.bincount(drawn, minlength=VOCAB) / len(drawn)
    np.testing.assert_allclose(freq, np.exp(LOGITS[0]), atol=0.03)


def test_same_seed_and_step_give_the_same_draw_wherever_the_row_sits():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32)
    sb = _batch(4, temperature=np.ones(4), seeds=[11, 12, 13, 14], steps=[0, 5, 2, 9])
    first = np.asarray(sample_tokens(logits, sb, num_logprobs=1).tokens)
    order = [2, 0, 3, 1]
    permuted = _batch(
        4, temperature=np.ones(4), seeds=np.array([11, 12, 13, 14])[order], steps=np.array([0, 5, 2, 9])[order]
    )
    second = np.asarray(sample_tokens(logits[order], permuted, num_logprobs=1).tokens)
    np.testing.assert_array_equal(first[order], second)


def _penalised_reference(logits, history, prompt_len, presence, frequency, repetition):
    """vLLM's penalties written out for one row."""
    out = logits.copy()
    seen = {t for t in history if t >= 0}
    outputs = [t for t in history[prompt_len:] if t >= 0]
    for t in seen:
        out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
    for t in set(outputs):
        out[t] -= frequency * outputs.count(t) + presence
    return out


@pytest.mark.parametrize(
    "presence,frequency,repetition", [(0.0, 0.0, 1.7), (0.0, 0.8, 1.0), (1.5, 0.0, 1.0), (0.5, 0.3, 1.2)]
)
def test_penalties_match_the_written_out_rule(presence, frequency, repetition):
    rng = np.random.default_rng(2)
    history = np.array([[3, 1, 3, 5, 5, 5]], np.int32)  # prompt 3, 1; outputs 3, 5, 5, 5
    for trial in range(20):
        logits = rng.normal(size=(1, VOCAB)).astype(np.float32) * 2
        sb = _batch(
            1,
            history=history,
            prompt_lens=[2],
            presence_penalty=[presence],
            frequency_penalty=[frequency],
            repetition_penalty=[repetition],
        )
        expected = _penalised_reference(logits[0], history[0], 2, presence, frequency, repetition).argmax()
        assert int(sample_tokens(logits, sb, num_logprobs=1).tokens[0]) == expected, trial


def test_banned_tokens_are_never_drawn():
    logits = np.zeros((1, VOCAB), np.float32)
    logits[0, 4] = 10.0
    sb = _batch(1, banned=[[4, 6, -1, -1]], min_tokens=[1])
    assert int(sample_tokens(logits, sb, num_logprobs=1).tokens[0]) != 4
    after = _batch(1, banned=[[4, 6, -1, -1]], min_tokens=[1], steps=[1])  # output index 1: min_tokens reached
    assert int(sample_tokens(logits, after, num_logprobs=1).tokens[0]) == 4
    sampled = _draws(logits, n=200)
    assert 4 in set(sampled)  # without the ban it dominates


def test_top_logprobs_only_when_some_row_asks():
    logits = np.random.default_rng(1).normal(size=(2, VOCAB)).astype(np.float32)
    out = sample_tokens(logits, _batch(2, wants_logprobs=[False, False]), num_logprobs=3)
    np.testing.assert_array_equal(out.tokens, logits.argmax(-1))
    np.testing.assert_array_equal(out.top_ids, 0)
    np.testing.assert_array_equal(out.logprob, 0)
    asked = sample_tokens(logits, _batch(2, wants_logprobs=[False, True]), num_logprobs=3)
    np.testing.assert_array_equal(asked.top_ids[1], np.argsort(-logits[1])[:3])
    np.testing.assert_allclose(asked.logprob[1], logits[1].max() - np.log(np.exp(logits[1]).sum()), rtol=1e-5)


def test_a_draw_is_jax_categorical_with_the_rows_key():
    """The draw is `jax.random.categorical` under key (seed, output index), written apart from it."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 64)).astype(np.float32) * 2
    seeds, steps = np.arange(20, 26, dtype=np.uint32), np.array([0, 1, 7, 3, 100, 2], np.int32)
    out = sample_tokens(logits, _batch(6, temperature=np.full(6, 0.5), seeds=seeds, steps=steps), num_logprobs=1)
    keys = [jax.random.fold_in(jax.random.key(int(seed)), int(step)) for seed, step in zip(seeds, steps)]
    expected = [int(jax.random.categorical(key, row / 0.5)) for key, row in zip(keys, logits)]
    np.testing.assert_array_equal(out.tokens, expected)


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([0.0, 1.0, 2.5, -1.0, np.inf, -np.inf, np.nan]), min_size=5, max_size=5),
        min_size=1,
        max_size=4,
    )
)
def test_argmax_is_numpys_on_ties_infinities_and_nan(rows):
    x = np.array(rows, np.float32)
    np.testing.assert_array_equal(jax.jit(sampler._argmax)(x), np.argmax(x, axis=-1))


def test_verify_rows_draw_each_output_index_as_a_plain_step_would():
    """A sequence with 2 drafts samples 3 rows (width 4: the first row unused); row j must
    draw output index steps + j with the drafts before it in the penalties' history and
    min_tokens counted per index: the same draws as three plain one-row steps."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(4, VOCAB)).astype(np.float32) * 2
    history = np.array([[3, 1, 3, 5, 2, 7]], np.int32)  # prompt 3, 1; output 3, 5; drafts 2, 7
    settings = dict(
        temperature=[0.9],
        seeds=[5],
        prompt_lens=[2],
        presence_penalty=[0.7],
        repetition_penalty=[1.3],
        banned=[[2, -1, -1, -1]],
        min_tokens=[4],
    )
    verify = _sample(
        logits,
        _batch(1, history=history, history_lens=[4], steps=[2], sample_rows=[[0, 1, 2, 3]], num_drafts=[2], **settings),
        num_logprobs=1,
    )
    for j in range(3):
        limit = 4 + j
        plain = _batch(
            1, history=np.where(np.arange(6) < limit, history, -1), history_lens=[limit], steps=[2 + j], **settings
        )
        want = sample_tokens(logits[1 + j : 2 + j], plain, num_logprobs=1)
        assert int(verify.tokens[0, 1 + j]) == int(want.tokens[0]), j
        np.testing.assert_allclose(verify.logprob[0, 1 + j], want.logprob[0], rtol=1e-6)


def test_a_draft_is_drawn_as_the_target_will_draw_its_output_index():
    """The i-th draft after a sequence's last accepted row r uses the key of output index
    steps + (r - first row) + 1 + i: on the target's own logits it is the token a plain step
    draws there, whatever the seed, with min_tokens counted at that index."""
    n = 64
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(n, VOCAB)).astype(np.float32) * 2
    last = np.full(n, 2, np.int32)  # width 4, 2 drafts: rows 1..3 used, row 2 the last accepted
    settings = dict(
        temperature=np.full(n, 0.9),
        seeds=np.arange(n) * 7 + 1,
        banned=np.tile([[5, -1, -1, -1]], (n, 1)),
        min_tokens=np.full(n, 6),
    )
    verify = _batch(
        n, steps=np.full(n, 3), sample_rows=np.tile(np.arange(4), (n, 1)), num_drafts=np.full(n, 2), **settings
    )
    draft = jax.jit(sampler.draft_tokens)
    for i in range(3):
        index = 3 + (2 - 1) + 1 + i  # the last accepted row draws index 4; its i-th draft index 5 + i
        want = sample_tokens(logits, _batch(n, steps=np.full(n, index), **settings), num_logprobs=1).tokens
        got = draft(logits, verify, last, i)
        np.testing.assert_array_equal(got, want)
        assert (np.asarray(got) == 5).any() == (index >= 6), i  # banned below min_tokens only
    assert len(set(np.asarray(draft(logits, verify, last, 0)).tolist())) > 2  # drawn, not greedy


def test_logit_bias_allowed_ids_and_bad_ids_shape_the_draw_but_not_the_raw_logprobs():
    logits = np.repeat(LOGITS, 4, axis=0)
    sb = _batch(
        4,
        bias_ids=[[5, -1, -1], [-1, -1, -1], [-1, -1, -1], [1, -1, -1]],
        bias_values=[[10.0, 0, 0], [0, 0, 0], [0, 0, 0], [-3.0, 0, 0]],
        allowed_ids=[[-1, -1, -1], [6, 7, -1], [-1, -1, -1], [-1, -1, -1]],
        bad_ids=[[-1, -1], [-1, -1], [1, 2], [-1, -1]],
    )
    out = sample_tokens(logits, sb, num_logprobs=2)
    # greedy rows: +10 lifts token 5 above all; only 6 and 7 allowed (6 and 7 tie: argmax takes the
    # first); 1 and 2 banned leaves 3; token 1 lowered by 3 (0.4 * e^-3 < 0.3) leaves 2
    np.testing.assert_array_equal(out.tokens, [5, 6, 3, 2])
    expected = np.log(np.array([0.04, 0.03, 0.1, 0.3]))  # logprobs stay the model's
    np.testing.assert_allclose(out.logprob, expected, rtol=1e-5)
    sb = _batch(200, temperature=np.ones(200), allowed_ids=np.tile([3, 4, -1], (200, 1)))
    drawn = np.asarray(sample_tokens(np.repeat(LOGITS, 200, axis=0), sb, num_logprobs=2).tokens)
    assert set(drawn) == {3, 4}  # both drawn, nothing else


@dataclasses.dataclass(frozen=True)
class _Ids:  # the one field of a StepBatch that `sampler.fed` reads and replaces
    input_ids: jax.Array


def test_the_feed_replaces_only_the_tokens_it_names():
    """Ids and each history's last token come from the previous step's feed where the step
    names a row of it (a token the host has not read), else stay the host's; the penalties
    read the histories with those tokens in place."""
    sb = _batch(
        3,
        history=[[1, 2, 3, -1, -1, -1], [4, 5, -1, -1, -1, -1], [6, -1, -1, -1, -1, -1]],
        history_lens=[4, 2, 1],
        history_feed=[1, -1, 0],
    )
    sb = dataclasses.replace(sb, feed_rows=np.array([-1, 0, -1, 1], np.int32))  # [T]: 4 tokens
    ids, sb = sampler.fed(_Ids(np.array([10, 11, 12, 13], np.int32)), sb, np.array([70, 71, 72, 0], np.int32))
    assert np.asarray(ids.input_ids).tolist() == [10, 70, 12, 71]
    rows = sampler.row_settings(sb)
    assert np.asarray(sampler._history(sampler._per_row(sb, rows), rows)).tolist() == [
        [1, 2, 3, 71, -1, -1],
        [4, 5, -1, -1, -1, -1],
        [70, -1, -1, -1, -1, -1],
    ]


def test_a_repetition_penalty_counts_the_token_fed_from_the_previous_step():
    """A history whose last token the host has not read: the penalty applies to the token
    the previous step sampled (fed on the device), as if the host had written it."""
    host = _batch(1, history=[[3, 1, -1, -1, -1, -1]], history_lens=[2], repetition_penalty=[100.0])
    unread = dataclasses.replace(
        host, history=np.array([[3, -1, -1, -1, -1, -1]], np.int32), history_feed=np.zeros(1, np.int32)
    )
    assert int(np.asarray(sample_tokens(LOGITS, unread, num_logprobs=0).tokens)[0]) == 1  # before `fed`: not counted
    _, unread = sampler.fed(_Ids(np.zeros(1, np.int32)), unread, np.array([1], np.int32))
    want = int(np.asarray(sample_tokens(LOGITS, host, num_logprobs=0).tokens)[0])
    assert want == 2  # token 1, the most likely, penalised away
    assert int(np.asarray(sample_tokens(LOGITS, unread, num_logprobs=0).tokens)[0]) == want
