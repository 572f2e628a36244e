"""Request-level behaviour: sampling options through the engine, and bad input rejected early."""

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from tests.models.tiny_models import VOCAB_SIZE, hf_logits, random_prompt

PROMPT = random_prompt(17, 123)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(bamba_llm: LLM):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = bamba_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [random_prompt(n, n) for n in (5, 60, 33, 2, 90)]
    busy = bamba_llm.generate(
        others[:2] + [PROMPT] + others[2:],
        [SamplingParams(max_tokens=9, temperature=0.7, seed=i) for i in range(2)]
        + [params]
        + [SamplingParams(max_tokens=15, temperature=1.3) for _ in range(3)],
        use_tqdm=False,
    )
    assert busy[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True)
    assert bamba_llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_stop_token_ids_and_min_tokens(bamba_llm: LLM):
    greedy = bamba_llm.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False
    )
    tokens = greedy[0].outputs[0].token_ids
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    out = bamba_llm.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out.outputs[0].token_ids == tokens[: first + 1] and out.outputs[0].finish_reason == "stop"
    # min_tokens holds the stop token back: it may not be drawn before min_tokens outputs
    held = bamba_llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at], min_tokens=first + 2),
        use_tqdm=False,
    )[0]
    assert stop_at not in held.outputs[0].token_ids[: first + 2]
    assert len(held.outputs[0].token_ids) >= first + 2


def test_logprobs_are_returned_for_each_token(bamba_llm: LLM):
    out = bamba_llm.generate(
        [PROMPT], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True), use_tqdm=False
    )[0]
    sample = out.outputs[0]
    assert len(sample.logprobs) == 4
    for token, entry in zip(sample.token_ids, sample.logprobs):
        assert token in entry and len(entry) in (3, 4)
        assert entry[token].logprob == max(v.logprob for v in entry.values())  # greedy picks the most likely token
        assert entry[token].rank == 1 and sorted(v.rank for v in entry.values()) == [1, 2, 3]
        assert all(v.logprob <= 0 for v in entry.values())
    assert sample.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(sample.token_ids, sample.logprobs))
    )
    first_logits = bamba_llm.prompt_logits(PROMPT)[-1]
    expected = first_logits - np.log(np.exp(first_logits - first_logits.max()).sum()) - first_logits.max()
    top3 = np.argsort(-expected)[:3]
    assert set(sample.logprobs[0]) == set(int(t) for t in top3)
    for rank, t in enumerate(top3, start=1):
        assert sample.logprobs[0][int(t)].logprob == pytest.approx(float(expected[t]), abs=1e-4)
        assert sample.logprobs[0][int(t)].rank == rank


def test_a_sampled_token_outside_the_top_n_gets_its_rank_in_the_whole_vocabulary(bamba_llm: LLM):
    params = SamplingParams(max_tokens=6, temperature=5.0, seed=3, logprobs=1, ignore_eos=True)
    sample = bamba_llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    logits = bamba_llm.prompt_logits(PROMPT + sample.token_ids[:-1])[len(PROMPT) - 1 :]  # [6, vocab]
    for row, token, entry in zip(logits, sample.token_ids, sample.logprobs):
        assert entry[token].rank == 1 + int(np.sum(row > row[token]))
    assert any(entry[t].rank > 1 for t, entry in zip(sample.token_ids, sample.logprobs))  # temperature 5 strays
    assert sample.cumulative_logprob is not None
    unasked = bamba_llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert unasked.logprobs is None and unasked.cumulative_logprob is None


def test_length_and_max_tokens(bamba_llm: LLM):
    out = bamba_llm.generate([[5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    # As vLLM: an output that would pass max_model_len (320) is cut there, not refused.
    capped, unbounded = bamba_llm.generate(
        [[1] * 316, [2] * 310],
        [
            SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True),
        ],
        use_tqdm=False,
    )
    assert len(capped.outputs[0].token_ids) == 4 and capped.outputs[0].finish_reason == "length"
    assert len(unbounded.outputs[0].token_ids) == 10 and unbounded.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([[VOCAB_SIZE]], SamplingParams(), r"request 1: token id 128 is outside the vocabulary"),
        ([[-1]], SamplingParams(), r"request 1: token id -1 is outside"),
        ([[]], SamplingParams(), r"request 1: the prompt is empty"),
        (
            [[1] * 320],
            SamplingParams(max_tokens=5),
            r"request 1: the prompt \(320 tokens\) leaves no room for output within max_model_len=320",
        ),
        ([[1]], SamplingParams(temperature=-0.5), r"request 1: SamplingParams.temperature must be"),
        ([[1]], SamplingParams(top_p=0.0), r"SamplingParams.top_p must be a finite number in \(0, 1\]"),
        ([[1]], SamplingParams(top_p=1.5), r"SamplingParams.top_p must be a finite number in \(0, 1\]"),
        ([[1]], SamplingParams(max_tokens=0), r"SamplingParams.max_tokens must be an integer in \[1, "),
        ([[1]], SamplingParams(logprobs=99), r"SamplingParams.logprobs must be"),
        ([[1]], SamplingParams(stop_token_ids=[1000]), r"SamplingParams.stop_token_ids must be token ids"),
        (["text"], SamplingParams(), r"request 1: text prompts need a tokenizer.json"),
    ],
)
def test_bad_input_is_rejected_before_any_work(bamba_llm: LLM, prompt, params, match):
    compiled = bamba_llm.engine.runner.steps.compiled_on_demand
    good = [2, 3, 4]
    with pytest.raises(ValueError, match=match):
        # the bad request is second: the good one before it must not run either
        bamba_llm.generate([good] + prompt, [SamplingParams(max_tokens=2), params], use_tqdm=False)
    assert not bamba_llm.engine.has_unfinished
    assert bamba_llm.engine.runner.steps.compiled_on_demand == compiled


def test_unknown_sampling_key_names_the_key():
    with pytest.raises(ValueError, match="unknown sampling parameter 'temprature'"):
        SamplingParams.from_dict({"temprature": 0.5}, "request 3")


def test_unknown_engine_argument_is_rejected(tiny_models):
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seq'"):
        LLM(tiny_models["bamba"][0], max_num_seq=4)


def test_prompt_logprobs_match_the_reference_model_across_chunks(bamba_llm: LLM, tiny_models):
    prompt = random_prompt(150, 8)  # three prefill chunks of at most 64 tokens, beside another request
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    for _ in range(2):  # the second time too: computed again, not served from the cache
        out, other = bamba_llm.generate(
            [prompt, random_prompt(30, 19)], [params, SamplingParams(max_tokens=3)], use_tqdm=False
        )
        assert out.num_cached_tokens == 0 and other.prompt_logprobs is None
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        logits = hf_logits(tiny_models["bamba"][1], prompt).astype(np.float64)
        ref = logits - logits.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))  # [150, vocab]: after each token
        for j in range(1, len(prompt)):
            entry, row, token = out.prompt_logprobs[j], ref[j - 1], prompt[j]
            assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
            assert entry[token].rank == 1 + int(np.sum(row > row[token]))
            top2 = sorted((t for t in entry if entry[t].rank <= 2), key=lambda t: entry[t].rank)
            assert top2 == list(np.argsort(-row)[:2])
