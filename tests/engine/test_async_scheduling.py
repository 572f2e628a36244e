"""Async scheduling (`LLMEngine._step`): each step dispatched before the tokens of the step
before are read, those tokens fed to it on the device. Its outputs, log-probabilities, cache
hits and bookkeeping must be the synchronous loop's (`async_scheduling=False`), which the rest
of the suite checks against transformers."""

import time

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.run_config import DEFAULT_MODEL
from tests.models.tiny_models import VOCAB_SIZE, random_prompt, save_tiny_model

ARGS = dict(max_model_len=256, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False)
# One architecture per kind of recurrent state, and a plain transformer; bamba always runs.
ARCHS = ("bamba", "llama", "qwen3_5", "jamba", "lfm2", "nemotron_h")


def _requests() -> tuple[list, list[SamplingParams]]:
    """Prompts sharing a prefix (hits within the batch), and every sampling feature whose
    next draw depends on the tokens before: penalties over the history, min_tokens, seeded
    draws, stops on frequent tokens (sequences ending while the step after runs), n > 1."""
    shared = random_prompt(37, 1)
    prompts = [shared + random_prompt(3 + i, 10 + i) for i in range(7)] + [random_prompt(70, 3), random_prompt(2, 4)]
    stops = list(range(0, VOCAB_SIZE, 10))  # one token in ten ends a sequence
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.9, top_p=0.9, seed=7, logprobs=3),
        SamplingParams(
            max_tokens=14, temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.6, presence_penalty=0.4
        ),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3, min_tokens=4, stop_token_ids=stops),
        SamplingParams(max_tokens=16, temperature=1.0, seed=8, stop_token_ids=stops),
        SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=11, temperature=0.8, seed=11, logit_bias={5: 4.0}, top_k=5),
        SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]
    return prompts, params


def _summary(outs) -> tuple[list, list[float]]:
    """What must be equal (tokens, finish and stop reasons, the ids of each logprob entry)
    and the log-probabilities, equal up to float noise (a step's batch differs)."""
    exact, values = [], []
    for o in outs:
        entries = [e for c in o.outputs for e in c.logprobs or []] + [e for e in o.prompt_logprobs or [] if e]
        exact.append(
            (
                [c.token_ids for c in o.outputs],
                [c.finish_reason for c in o.outputs],
                [c.stop_reason for c in o.outputs],
                [list(e) for e in entries],
            )
        )
        values += [lp.logprob for e in entries for lp in e.values()]
    return exact, values


def _run(path, async_scheduling: bool, **extra) -> tuple[list, dict, LLM]:
    llm = LLM(path, **ARGS, **extra, async_scheduling=async_scheduling)
    prompts, params = _requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts[:3], params[:3], use_tqdm=False)  # hits on the first run's pages
    llm.engine.drain()
    sched = llm.engine.scheduler
    sched.check_invariants()
    assert not sched.running and not sched.waiting and sched.cache.pool.num_referenced == 0
    assert not sched.cache.pending  # every checkpoint written was kept or given back
    return _summary(outs + again), llm.stats(), llm


@pytest.mark.parametrize("arch", [a if a == "bamba" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def test_outputs_and_cache_equal_the_synchronous_loop(tmp_path, arch):
    save_tiny_model(arch, tmp_path)
    store = dict(compilation_cache_dir=str(tmp_path / "compiled"))  # the two share executables
    (want, want_lp), want_stats, _ = _run(tmp_path, False, **store)
    (got, got_lp), stats, _ = _run(tmp_path, True, **store)
    assert got == want
    assert got_lp == pytest.approx(want_lp, abs=1e-3) and len(got_lp) > 100
    assert stats["steps_overlapped"] > 0.5 * (stats["steps_overlapped"] + stats["steps_synchronous"])
    assert want_stats["steps_overlapped"] == 0
    # The same hits. (Not always the same checkpoints: a save whose prefix ends past a token
    # not read yet is reserved before the host can see that another sequence cached it.)
    for key in ("tokens_asked", "tokens_hit", "tokens_lost_for_want_of_checkpoint"):
        assert stats[key] == want_stats[key], key
    assert stats["tokens_hit"] > 0


def test_preemption_and_eviction_under_a_small_pool(tmp_path):
    """A pool that holds about two sequences: sequences are preempted while a token of
    theirs is not read yet, and recomputed with it."""
    save_tiny_model("bamba", tmp_path)
    store = dict(compilation_cache_dir=str(tmp_path / "compiled"), num_cache_blocks=1 + 40)
    (want, want_lp), _, _ = _run(tmp_path, False, **store)
    (got, got_lp), stats, llm = _run(tmp_path, True, **store)
    assert got == want and got_lp == pytest.approx(want_lp, abs=1e-3)
    assert llm.engine.scheduler.num_preemptions > 0 and stats["steps_overlapped"] > 0


def test_abort_while_a_step_is_in_flight(tmp_path):
    """A request aborted between the dispatch of a step and the read of its tokens gives back
    everything it holds; the others' outputs are those of a run without it."""
    save_tiny_model("bamba", tmp_path)
    llm = LLM(tmp_path, **ARGS, compilation_cache_dir=str(tmp_path / "compiled"))
    engine = llm.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [random_prompt(20 + i, 30 + i) for i in range(3)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)]
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine._in_flight is None or not all(s.num_unfilled for s in seqs):
        engine.step()  # until every sequence decodes with a token not read yet
    engine.abort(seqs[2])
    while engine.has_unfinished:
        engine.step()
    assert [s.output_token_ids for s in seqs[:2]] == alone
    assert seqs[2].finish_reason == "abort" and seqs[2].num_unfilled == 0
    engine.scheduler.check_invariants()
    assert engine.scheduler.cache.pool.num_referenced == 0 and not engine.scheduler.slots.in_use


@pytest.fixture(scope="module")
def text_llms():
    """The embedded model, async and synchronous, for requests given as text."""
    llms = [LLM(DEFAULT_MODEL, max_model_len=512, warm_up=False, async_scheduling=a) for a in (True, False)]
    yield llms
    for llm in llms:
        llm.shutdown()


def test_stop_strings_grammars_and_bad_words(text_llms):
    """Stop strings end a sequence one step late on the host (the extra token is dropped);
    a grammar's mask and bad words need the last token on the host, so those steps wait for it
    (counted as synchronous) and the rest overlap."""
    prompts = ["def add(a, b):", "The capital of France is", "import numpy as np", "Hello"]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop=["\n", "return"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=16, temperature=0.0, structured_outputs={"regex": "[a-z ]{3,12}\\."}),
        SamplingParams(max_tokens=16, temperature=0.8, seed=3, bad_words=["np", " ("]),
        SamplingParams(max_tokens=20, temperature=0.0, stop=["."]),
    ]
    results = []
    for llm in text_llms:
        before = llm.stats()["steps_synchronous"]
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs])
        llm.engine.scheduler.check_invariants()
        results[-1].append(llm.stats()["steps_synchronous"] - before)
    (*got, synchronous), (*want, _) = results
    assert got == want
    assert any(reason == "stop" for _, _, reason in got)
    assert synchronous > 0  # the grammar's and the bad words' steps
    alone = text_llms[0].generate(prompts[::3], [params[0], params[3]], use_tqdm=False)
    assert text_llms[0].stats()["steps_overlapped"] > 0
    assert [o.outputs[0].text for o in alone] == [got[0][0], got[3][0]]


def test_a_step_left_running_after_its_sequences_ended_is_not_timed(tmp_path):
    """A sequence that stops on a token has run one more step, in flight when `generate`
    returns; read only when the next request comes, it is not a step's time."""
    save_tiny_model("bamba", tmp_path)
    llm = LLM(tmp_path, **ARGS, compilation_cache_dir=str(tmp_path / "compiled"))
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=1, stop_token_ids=list(range(0, VOCAB_SIZE, 10)))
    (out,) = llm.generate([random_prompt(9, 5)], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop"
    assert llm.engine._in_flight is not None  # the step after its stop
    time.sleep(0.5)
    llm.generate([random_prompt(9, 6)], params, use_tqdm=False)
    timeline = llm.engine.timeline
    assert timeline.recent and timeline.busy_seconds < 0.4  # the half second waited is nobody's


def test_a_sequence_preempted_with_an_unread_token_is_recomputed_in_chunks(tmp_path):
    """Without prefix caching a preempted sequence is recomputed from scratch, in chunks of
    the token budget: taken back in the same step that preempted it, its first chunk stops
    before the token not read yet (no feed), and a later chunk takes it in."""
    save_tiny_model("bamba", tmp_path)
    args = {**ARGS, "enable_prefix_caching": False, "num_cache_blocks": 1 + 40}
    prompts = [random_prompt(50, 40 + i) for i in range(3)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)  # 150 of the pool's 160 tokens
    outs = {}
    for on in (False, True):
        llm = LLM(tmp_path, **args, async_scheduling=on, compilation_cache_dir=str(tmp_path / "compiled"))
        outs[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
        llm.engine.scheduler.check_invariants()
    assert outs[True] == outs[False]


def test_a_speculating_engine_overlaps_the_steps_in_which_no_sequence_speculates(tmp_path):
    """Sequences admitted without speculation (the gate's call) decode overlapped; those
    that speculate have their drafts looked up and accepted on the host, so their steps wait.
    With the gate, a sequence whose lookups find nothing looks up again only when a try is
    due, and decodes overlapped meanwhile. Tokens are a plain engine's in every case."""
    save_tiny_model("bamba", tmp_path)
    store = dict(compilation_cache_dir=str(tmp_path / "compiled"))
    always = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}  # every sequence speculates
    prompts = [random_prompt(12, 7) * 3, random_prompt(20, 8)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(tmp_path, **ARGS, **store).generate(prompts, params, use_tqdm=False)]
    for case in ("speculating", "not admitted", "adaptive, nothing found"):
        spec = {**always, "adaptive": True} if case.startswith("adaptive") else always
        llm = LLM(tmp_path, **ARGS, **store, speculative_config=spec)
        lookups = []
        if case == "not admitted":  # as when the gate finds that speculation does not pay
            llm.engine.scheduler.speculates = lambda load, hit_has_draft_state: False
        if case.startswith("adaptive"):
            llm.engine.spec.propose = lambda seq, limit, found=lookups: found.append(seq) or []
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want, case
        stats = llm.stats()
        if case == "speculating":  # each decode step waits for the lookup after the one before
            assert stats["steps_overlapped"] < stats["steps_synchronous"]
        else:
            assert stats["spec_draft_tokens"] == 0 and stats["steps_overlapped"] > stats["steps_synchronous"]
        if case.startswith("adaptive"):  # one lookup each, then a try after 16 and 32 more steps
            assert 2 <= len(lookups) <= 2 * 3, len(lookups)
