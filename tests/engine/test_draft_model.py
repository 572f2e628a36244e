"""Speculative decoding with a draft model: its drafts are the draft's own greedy continuation
(transformers without a cache: after a prefill, after verify steps that accept every draft or
none, after a prefix hit), the tokens are those of plain decoding, a draft that is the target
itself is always accepted, on a prefix hit and when sampling too, and a draft that cannot
serve is refused."""

import json
import shutil

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from tests.engine.test_pool_donation import assert_no_step_copies_a_pool
from tests.engine.test_speculative import (
    ARGS,
    K,
    _params,
    _poison_unread_slots,
    _prompts,
    _run,
    check_admission_without_speculation,
)
from tests.models.tiny_models import hf_greedy, random_prompt, save_tiny_model

# (target, draft) architectures: hybrid for hybrid, plain for plain, plain for hybrid, and a
# Mamba2 hybrid drafting for a Gated DeltaNet one.
PAIRS = [
    ("bamba", "bamba"),
    pytest.param(("llama", "llama"), marks=pytest.mark.slow),
    pytest.param(("bamba", "llama"), marks=pytest.mark.slow),
    pytest.param(("qwen3_5", "bamba"), marks=pytest.mark.slow),
]


def _spec(draft_dir, **more) -> dict:
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": K, "adaptive": False, **more}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(arch, seed) -> (model_dir, torch model), built on first use."""
    built = {}

    def get(arch: str, seed: int = 0):
        if (arch, seed) not in built:
            path = tmp_path_factory.mktemp(f"{arch}_{seed}")
            built[arch, seed] = (path, save_tiny_model(arch, path, seed=seed))
        return built[arch, seed]

    return get


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_drafts_are_the_draft_models_greedy_continuation(models, pair):
    (target_dir, target), (draft_dir, draft) = models(pair[0]), models(pair[1], seed=1)
    engine = LLM(target_dir, speculative_config=_spec(draft_dir), **ARGS).engine
    prompt = random_prompt(21, 0)
    seq = engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's prefill
    assert seq.spec.drafts == hf_greedy(draft, seq.tokens, K)

    seq.spec.drafts = hf_greedy(target, seq.tokens, K)  # right drafts: all accepted
    engine.step()
    assert len(seq.tokens) == 21 + 1 + K + 1
    assert seq.spec.drafts == hf_greedy(draft, seq.tokens, K)

    right = hf_greedy(target, seq.tokens, 1)[0]
    seq.spec.drafts = [(right + 1) % target.config.vocab_size] * K  # wrong drafts: none accepted
    engine.step()
    assert seq.tokens[-1] == right
    assert seq.spec.drafts == hf_greedy(draft, seq.tokens, K)

    again = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    engine.step()  # a prefix hit: the draft's KV pages and checkpoint come from the cache
    assert again.num_cached_tokens == 20
    assert again.spec.drafts == hf_greedy(draft, again.tokens, K)


@pytest.mark.slow  # test_mtp.py runs the same checks fast for in-step drafting; the draft's states: below
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
def test_tokens_are_those_of_plain_decoding(models, pair):
    """Mixed prefill and verify steps, stop tokens, min_tokens and prefix hits (`_run`), NaN in
    every live slot not read next (the target's and the draft's), and seeded sampling."""
    (target_dir, _), (draft_dir, _) = models(pair[0]), models(pair[1], seed=1)
    plain = LLM(target_dir, **ARGS)
    stop_id = plain.generate(_prompts()[2:3], _params(0)[0], use_tqdm=False)[0].outputs[0].token_ids[5]
    want = _run(plain, stop_id)
    assert any(reason == "stop" for _, reason in want)
    llm = LLM(target_dir, speculative_config=_spec(draft_dir), **ARGS)
    if llm.engine.scheduler.slots is not None:
        _poison_unread_slots(llm)
    assert _run(llm, stop_id) == want
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["tokens_hit"] > 0
    sampled = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=s, top_k=k, top_p=p, ignore_eos=True)
        for s, k, p in ((1, 0, 1.0), (2, 20, 1.0), (3, 0, 0.7))
    ]
    prompts = _prompts()[:3]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sampled, use_tqdm=False)] == [
        o.outputs[0].token_ids for o in plain.generate(prompts, sampled, use_tqdm=False)
    ]
    llm.engine.scheduler.check_invariants()


@pytest.mark.slow  # prefix hits under in-step drafting: run fast by test_mtp.py's drafts test
def test_the_target_as_its_own_draft_is_always_accepted_on_a_prefix_hit_too(models):
    """Every draft agrees only if the draft's KV and states at every position are the
    target's: through page boundaries, verify steps and a 300-token prompt's prefix hit."""
    path, model = models("bamba")
    llm = LLM(path, speculative_config=_spec(path), **ARGS)
    prompt = random_prompt(300, 7)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == hf_greedy(model, prompt, 30)
    assert second.num_cached_tokens >= 272
    stats = llm.stats()
    assert stats["spec_draft_tokens"] >= 2 * 5 * K and stats["spec_acceptance_rate"] == 1.0


def test_the_target_as_its_own_draft_is_accepted_when_sampling_too(models):
    """A draft draws with the key the target will use for that output index, so a draft
    with the target's distribution draws the target's tokens at any temperature (drafting
    greedily would keep a draft only with the target's probability of its top token)."""
    path, _ = models("bamba")
    llm = LLM(path, speculative_config=_spec(path), **ARGS)
    params = [
        SamplingParams(max_tokens=24, temperature=t, top_k=k, seed=s, ignore_eos=True)
        for t, k, s in ((1.0, 0, 1), (0.7, 20, 2), (1.5, 0, 3))
    ]
    outs = llm.generate(_prompts()[:3], params, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3
    stats = llm.stats()
    assert stats["spec_draft_tokens"] >= 3 * 4 * K and stats["spec_acceptance_rate"] >= 0.95, stats


@pytest.mark.slow  # the host's preemption of in-step drafting is run fast by test_mtp.py
def test_tokens_are_those_of_plain_decoding_under_preemption(models):
    """Twelve requests through four sequence slots and a pool of about two long ones: sequences
    preempted mid-speculation are recomputed, the draft's pages and states with them."""
    (path, model), (draft_dir, _) = models("bamba"), models("bamba", seed=1)
    prompts = [random_prompt(int(n), 50 + i) for i, n in enumerate(np.random.default_rng(5).integers(20, 120, 12))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm = LLM(path, speculative_config=_spec(draft_dir), **{**ARGS, "num_cache_blocks": 1 + 70})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.stats()["spec_draft_tokens"] > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 24)
    llm.engine.scheduler.check_invariants()


@pytest.mark.parametrize("decode", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["verify", "prefill"])
def test_no_step_copies_a_pool_with_a_draft_model(models, decode):
    """The draft's pools are donated and written in place too, its drafting loop included."""
    (path, _), (draft_dir, _) = models("bamba"), models("bamba", seed=1)
    assert_no_step_copies_a_pool(LLM(path, speculative_config=_spec(draft_dir), **ARGS).engine, decode)


def test_the_cache_blocks_hold_the_draft_models_pages_too(models):
    """A block's bytes are one page of the target's and of the draft's attention layers, so a
    memory budget buys fewer blocks with a draft than without."""
    (path, _), (draft_dir, _) = models("bamba"), models("llama", seed=1)
    budget = {**ARGS, "kv_cache_memory_bytes": 1 << 20}
    alone, drafted = LLM(path, **budget).engine, LLM(path, speculative_config=_spec(draft_dir), **budget).engine
    a, d = alone.model_config.attention, drafted.draft_config.attention
    page = 2 * ARGS["page_size"] * 4  # K and V, float32
    assert alone.block_bytes == page * a.num_kv_heads * a.head_dim * alone.model_config.num_attention_layers
    assert drafted.block_bytes == alone.block_bytes + page * d.num_kv_heads * d.head_dim * 2  # llama: 2 layers
    assert drafted.scheduler.cache.pool.num_usable < alone.scheduler.cache.pool.num_usable


def _edited(src, dst, **fields):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **fields}))
    return dst


@pytest.mark.slow  # the host's admission without speculation is run fast by test_mtp.py's twin
def test_a_request_admitted_without_speculation_skips_the_draft_model_and_so_do_its_hits(models):
    """The draft model's first attention layer's KV pages: see `check_admission_without_speculation`."""
    (target_dir, target), (draft_dir, _) = models("bamba"), models("bamba", seed=1)
    engine = LLM(target_dir, speculative_config=_spec(draft_dir, adaptive=True), **ARGS).engine
    check_admission_without_speculation(engine, target, "draft_pools", 0)


def test_a_draft_that_cannot_serve_the_target_is_refused(models, tmp_path):
    (bamba, _), (llama, _), (mamba2, _) = models("bamba"), models("llama", seed=1), models("mamba2")
    cases = [
        (bamba, tmp_path / "nowhere", "is not a model directory"),
        (bamba, _edited(llama, tmp_path / "vocab", vocab_size=256), r"vocabulary \(256 tokens\)"),
        (llama, bamba, "has recurrent layers"),
        (mamba2, llama, "has attention layers"),
        (bamba, _edited(llama, tmp_path / "short", max_position_embeddings=128), "max_position_embeddings=128"),
    ]
    for target, draft, message in cases:
        with pytest.raises(ValueError, match=f"speculative_config.model=.*{message}"):
            LLM(target, speculative_config=_spec(draft), **ARGS)
