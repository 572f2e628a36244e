"""Speculative decoding with the model's own MTP module: its drafts are those of a torch
reference run without a cache (after a prefill, after verify steps that accept every draft
or none, after a prefix hit), and the tokens are those of plain decoding."""

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from tests.engine.test_pool_donation import assert_no_step_copies_a_pool
from tests.engine.test_speculative import ARGS, K, _params, _prompts, _run, check_admission_without_speculation
from tests.models.tiny_models import hf_greedy, random_prompt, save_tiny_model
from tests.models.tiny_mtp import add_tiny_mtp, reference_drafts

MTP = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}
ARCHS = ("llama", "bamba", "qwen3_5", "nemotron_h")


def _slow_but(fast: str):
    return [a if a == fast else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS]


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory) -> dict:
    """{arch: (model_dir, torch model, torch MTP module)}, built on first use."""
    built = {}

    def get(arch: str):
        if arch not in built:
            path = tmp_path_factory.mktemp(f"{arch}_mtp")
            model = save_tiny_model(arch, path)
            built[arch] = (path, model, add_tiny_mtp(model, path))
        return built[arch]

    return get


@pytest.mark.parametrize("arch", _slow_but("bamba"))
def test_drafts_are_the_modules_greedy_drafts(mtp_models, arch):
    path, model, mtp = mtp_models(arch)
    engine = LLM(path, speculative_config=MTP, **ARGS).engine
    prompt = random_prompt(21, 0)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's prefill
    assert seq.spec.drafts == reference_drafts(model, mtp, seq.tokens, K)

    seq.spec.drafts = hf_greedy(model, seq.tokens, K)  # right drafts: all accepted, the MTP reads the last row
    engine.step()
    assert len(seq.tokens) == 21 + 1 + K + 1
    assert seq.spec.drafts == reference_drafts(model, mtp, seq.tokens, K)

    right = hf_greedy(model, seq.tokens, 1)[0]
    seq.spec.drafts = [(right + 1) % model.config.vocab_size] * K  # wrong drafts: none accepted
    engine.step()
    assert seq.tokens[-1] == right
    assert seq.spec.drafts == reference_drafts(model, mtp, seq.tokens, K)

    again = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()  # a prefix hit: the MTP layer's KV of the cached pages comes from the cache
    assert again.num_cached_tokens == 20
    assert again.spec.drafts == reference_drafts(model, mtp, again.tokens, K)


@pytest.mark.slow  # tokens under MTP speculation: run fast under preemption below
@pytest.mark.parametrize("arch", ARCHS)
def test_tokens_are_those_of_plain_decoding(mtp_models, arch):
    """Mixed prefill and verify steps, stop tokens, min_tokens and prefix hits (`_run`), and
    seeded sampling."""
    path, model, _ = mtp_models(arch)
    plain = LLM(path, **ARGS)
    stop_id = plain.generate(_prompts()[2:3], _params(0)[0], use_tqdm=False)[0].outputs[0].token_ids[5]
    want = _run(plain, stop_id)
    assert any(reason == "stop" for _, reason in want)
    llm = LLM(path, speculative_config=MTP, **ARGS)
    assert _run(llm, stop_id) == want
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["tokens_hit"] > 0
    # Seeded sampling: each verify row draws with the request's key for its output index.
    sampled = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=s, top_k=k, top_p=p, ignore_eos=True)
        for s, k, p in ((1, 0, 1.0), (2, 20, 1.0), (3, 0, 0.7))
    ]
    prompts = _prompts()[:3]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, sampled, use_tqdm=False)
    ]
    llm.engine.scheduler.check_invariants()


@pytest.mark.slow  # prefix hits under MTP: also in test_tokens_are_those_of_plain_decoding; under ngram: fast
def test_a_repeated_prompt_hits_under_mtp_speculation_on_the_first_repeat(mtp_models):
    path, _, _ = mtp_models("bamba")
    llm = LLM(path, speculative_config=MTP, **ARGS)
    prompt = random_prompt(300, 7)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, second = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens >= 272 and second.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.stats()["spec_draft_tokens"] > 0


def test_mtp_on_a_model_without_an_mtp_module_is_refused(tmp_path):
    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="speculative_config.method='mtp'.*declares no MTP module"):
        LLM(tmp_path, speculative_config=MTP, **ARGS)


@pytest.mark.parametrize("decode", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["verify", "prefill"])
def test_no_step_copies_a_pool_with_the_mtp_module(mtp_models, decode):
    """The MTP layer's KV pages are written in place too, in the main pass and in the drafting
    chain under its `lax.cond`."""
    path, _, _ = mtp_models("bamba")
    assert_no_step_copies_a_pool(LLM(path, speculative_config=MTP, **ARGS).engine, decode)


def test_tokens_are_those_of_plain_decoding_under_preemption(mtp_models):
    """Twelve requests through four sequence slots and a KV pool of about two long ones:
    sequences preempted mid-speculation are recomputed and draft again from their new steps."""
    path, model, _ = mtp_models("bamba")
    prompts = [random_prompt(int(n), 50 + i) for i, n in enumerate(np.random.default_rng(5).integers(20, 120, 12))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(path, speculative_config=MTP, **{**ARGS, "num_cache_blocks": 1 + 70})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.stats()["spec_draft_tokens"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 24)
    llm.engine.scheduler.check_invariants()


def test_a_request_admitted_without_speculation_skips_the_module_and_so_do_its_hits(mtp_models):
    """The MTP layer's KV pages: see `check_admission_without_speculation`."""
    path, model, _ = mtp_models("bamba")
    engine = LLM(path, speculative_config={**MTP, "adaptive": True}, **ARGS).engine
    check_admission_without_speculation(engine, model, "pools", engine.model_config.num_attention_layers)
