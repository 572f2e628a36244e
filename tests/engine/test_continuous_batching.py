"""Continuous batching end to end: many requests, chunked prefill, preemption, fixed shapes."""

import numpy as np
import pytest
import torch

from jaxengine import LLM, SamplingParams
from tests.engine.conftest import ENGINE_ARGS
from tests.engine.test_sampler import _penalised_reference
from tests.models.tiny_models import hf_greedy, random_prompt


def _workload(seed: int, n: int = 64) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 240, size=n)
    max_tokens = rng.integers(1, 9, size=n)
    return [random_prompt(int(length), seed * 1000 + i) for i, length in enumerate(lengths)], [
        int(m) for m in max_tokens
    ]


@pytest.mark.parametrize("arch", ["bamba", pytest.param("llama", marks=pytest.mark.slow)])  # attention: in bamba
def test_greedy_matches_transformers_under_preemption(tiny_models, arch):
    """64 requests of 1-240 tokens through 8 sequence slots, a 64-token budget and a KV pool
    that holds about two long requests (cached pages and checkpoints included): every
    request's greedy tokens equal transformers' for that prompt alone, preemption did happen,
    and every block and slot comes back."""
    path, hf_model = tiny_models[arch]
    llm = LLM(path, **{**ENGINE_ARGS, "num_cache_blocks": 1 + 130, "warm_up": False})
    prompts, max_tokens = _workload(seed=1)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, m, out in zip(prompts, max_tokens, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, m), f"prompt of {len(prompt)} tokens"
        assert out.outputs[0].finish_reason == "length"
    sched = llm.engine.scheduler
    assert sched.num_preemptions > 0
    assert not sched.running and not sched.waiting
    sched.check_invariants()
    assert sched.cache.pool.num_referenced == 0 and not sched.cache.pending
    assert all(c.pins == 0 for c in sched.cache.checkpoints.values())
    if sched.slots is not None:
        assert not sched.slots.in_use


@pytest.mark.slow  # waits for every shape to compile; test_background_compile.py checks the serving side fast
def test_no_compiles_after_warm_up(bamba_llm):
    """After warm-up, no step of a run over mixed prompt lengths waits for a compile (shapes
    still compiling in the background are served by larger ready ones), and the background
    thread ends with every shape ready."""
    steps = bamba_llm.engine.runner.steps
    prompts, _ = _workload(seed=2, n=12)
    bamba_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert steps.compiled_on_demand == 0
    steps.wait()
    assert len(steps.ready) == len(bamba_llm.engine.shapes())
    bamba_llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert steps.compiled_on_demand == 0 and len(steps.ready) == len(bamba_llm.engine.shapes())


def test_streaming_yields_the_same_tokens_as_generate(bamba_llm):
    prompts = [random_prompt(n, 50 + n) for n in (3, 20, 70)]
    params = SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in bamba_llm.generate(prompts, params, use_tqdm=False)]
    streamed = [[] for _ in prompts]
    finished = set()
    for event in bamba_llm.generate_stream(prompts, params):
        assert event.index not in finished
        streamed[event.index].extend(event.new_token_ids)
        if event.finished:
            finished.add(event.index)
            assert event.output.outputs[0].token_ids == streamed[event.index]
    assert streamed == expected and finished == {0, 1, 2}


def test_metrics_are_recorded(bamba_llm):
    out = bamba_llm.generate([random_prompt(30, 9)], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.time_to_first_token is not None and out.time_to_first_token > 0
    assert out.time_per_output_token is not None and out.time_per_output_token > 0


def _hf_penalised_greedy(model, prompt: list[int], max_new_tokens: int, presence, frequency, repetition) -> list[int]:
    """The reference model's greedy continuation under vLLM's penalties, written out (the
    rule `test_sampler.py` checks the sampler against), a full forward per token."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].detach().numpy().astype(np.float64)
        history = np.array(ids)
        logits = _penalised_reference(logits, history, len(prompt), presence, frequency, repetition)
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


def test_penalties_over_long_histories_match_transformers(tiny_models):
    """Greedy decode with repetition, frequency and presence penalties beside a request with
    none, in one batch, over prompts of 3 to 180 tokens: each request's tokens equal the
    reference's under the written-out rule. The penalised histories are built from each
    sequence's token array, extended step by step (`Sequence.token_array`), across its growth."""
    path, hf_model = tiny_models["bamba"]
    llm = LLM(path, **{**ENGINE_ARGS, "warm_up": False})
    prompts = [random_prompt(180, 3), random_prompt(3, 4), random_prompt(60, 5), random_prompt(25, 6)]
    settings = [(0.0, 0.0, 1.6), (0.5, 0.3, 1.2), None, (1.0, 0.0, 1.0)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        if s is None
        else SamplingParams(
            max_tokens=20,
            temperature=0.0,
            ignore_eos=True,
            presence_penalty=s[0],
            frequency_penalty=s[1],
            repetition_penalty=s[2],
        )
        for s in settings
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, s, out in zip(prompts, settings, outs):
        want = hf_greedy(hf_model, prompt, 20) if s is None else _hf_penalised_greedy(hf_model, prompt, 20, *s)
        assert out.outputs[0].token_ids == want, (len(prompt), s)
