"""Request-level behaviour: sampling options through the engine, and bad input rejected early."""

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from tests.models.tiny_models import VOCAB_SIZE, random_prompt

PROMPT = random_prompt(17, 123)


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(bamba_llm: LLM):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = bamba_llm.generate([PROMPT], params, use_tqdm=False)[0].token_ids
    others = [random_prompt(n, n) for n in (5, 60, 33, 2, 90)]
    busy = bamba_llm.generate(
        others[:2] + [PROMPT] + others[2:],
        [SamplingParams(max_tokens=9, temperature=0.7, seed=i) for i in range(2)] + [params]
        + [SamplingParams(max_tokens=15, temperature=1.3) for _ in range(3)],
        use_tqdm=False,
    )
    assert busy[2].token_ids == alone
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=43, ignore_eos=True)
    assert bamba_llm.generate([PROMPT], other_seed, use_tqdm=False)[0].token_ids != alone


def test_stop_token_ids_and_min_tokens(bamba_llm: LLM):
    greedy = bamba_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    tokens = greedy[0].token_ids
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    out = bamba_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"
    # min_tokens holds the stop token back: it may not be drawn before min_tokens outputs
    held = bamba_llm.generate(
        [PROMPT], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_at], min_tokens=first + 2), use_tqdm=False
    )[0]
    assert stop_at not in held.token_ids[: first + 2]
    assert len(held.token_ids) >= first + 2


def test_logprobs_are_returned_for_each_token(bamba_llm: LLM):
    out = bamba_llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) in (3, 4)
        assert entry[token] == max(entry.values())  # greedy picks the most likely token
        assert all(v <= 0 for v in entry.values())
    first_logits = bamba_llm.prompt_logits(PROMPT)[-1]
    expected = first_logits - np.log(np.exp(first_logits - first_logits.max()).sum()) - first_logits.max()
    top3 = np.argsort(-expected)[:3]
    assert set(out.logprobs[0]) == set(int(t) for t in top3)
    for t in top3:
        assert out.logprobs[0][int(t)] == pytest.approx(float(expected[t]), abs=1e-4)


def test_length_and_max_tokens(bamba_llm: LLM):
    out = bamba_llm.generate([[5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([[VOCAB_SIZE]], SamplingParams(), r"request 1: token id 128 is outside the vocabulary"),
        ([[-1]], SamplingParams(), r"request 1: token id -1 is outside"),
        ([[]], SamplingParams(), r"request 1: the prompt is empty"),
        ([[1] * 318], SamplingParams(max_tokens=5), r"request 1: .* exceeds max_model_len=320"),
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
