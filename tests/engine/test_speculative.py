"""Speculative decoding: the same tokens as without it, whatever the drafts; rejected draft
positions' states never read; the config checked before any work."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams
from jaxengine.engine.spec.acceptance import accept
from jaxengine.engine.spec.config import SpeculativeConfig
from jaxengine.engine.spec.gate import ProbeBackoff, SpeculationGate
from jaxengine.engine.spec.ngram import NgramIndex
from jaxengine.engine.step_executables import shape_key
from jaxengine.run_config import ConfigError, load_run_config
from tests.models.tiny_models import VOCAB_SIZE, hf_greedy, random_prompt, save_tiny_model
from tests.property_examples import examples

ARGS = dict(
    max_model_len=384, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False, compilation_cache_dir=None
)
K = 3
# Always drafting (not `adaptive`), so every test verifies drafts whatever the step times.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}
# Attention only, Mamba2 with attention, Gated DeltaNet with gated attention, short convs
# with attention.
ARCHS = ("llama", "bamba", "qwen3_5", "lfm2", "falcon_h1", "zamba2", "jamba")


def _prompts() -> list[list[int]]:
    """Five prompts for four sequence slots (a late admission makes mixed prefill and verify
    steps); repetitive ones give ngram drafts."""
    loop = [5, 6, 7, 8, 9] * 5
    return [
        loop,
        random_prompt(37, 1),
        [3, 1, 4, 1, 5, 9, 2, 6] * 3,
        random_prompt(9, 2),
        loop[:13] + random_prompt(6, 3),
    ]


def _params(stop_id: int) -> list[SamplingParams]:
    greedy = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    return [
        greedy,
        greedy,
        dataclasses.replace(greedy, stop_token_ids=(stop_id,)),
        dataclasses.replace(greedy, min_tokens=10, stop_token_ids=(stop_id,)),
        greedy,
    ]


def _run(llm: LLM, stop_id: int) -> list[tuple[list[int], str]]:
    """Two rounds of the same prompts (the second hits the prefix cache)."""
    out = []
    for _ in range(2):
        out += [
            (o.outputs[0].token_ids, o.outputs[0].finish_reason)
            for o in llm.generate(_prompts(), _params(stop_id), use_tqdm=False)
        ]
    return out


def _oracle(want: dict[tuple, list[int]], wrong: bool):
    """Drafts that are the target's own greedy continuation (always accepted) or never it."""

    def draft(seq, limit):
        done = seq.num_output_tokens
        future = want[tuple(seq.tokens[: seq.num_prompt_tokens])][done : done + limit]
        return [(t + 1) % VOCAB_SIZE for t in future] if wrong else future

    return draft


def _poison_unread_slots(llm: LLM) -> None:
    """After every step, NaN into every live slot a running sequence owns but does not read
    next (the states after rejected draft positions among them): reading one shows."""
    engine = llm.engine
    update = engine.scheduler.update

    def poisoned(step, kept=None):
        update(step, kept)
        bad = [s for seq in engine.scheduler.running for s in seq.owned_slots if s != seq.read_slot]
        if bad:
            idx = jnp.asarray(bad)
            for name in ("pools", "draft_pools"):  # the target's, and a draft model's
                pools = getattr(engine.runner, name)
                if pools is not None:
                    states = tuple(tuple(a.at[idx].set(jnp.nan) for a in layer) for layer in pools.states)
                    setattr(engine.runner, name, dataclasses.replace(pools, states=states))

    engine.scheduler.update = poisoned


def check_admission_without_speculation(engine, model, pools_name: str, k_index: int) -> None:
    """Where the gate admits a request without speculation, the steps it runs alone leave the
    draft's KV pages untouched (the MTP module or draft model is skipped), it drafts nothing
    and its tokens are plain decoding's; a later request whose prefix hit covers its cached
    pages does not speculate either (their draft entries were never written), while one with
    another prompt does, and the draft writes its entries. The draft's K pages are
    `engine.runner.<pools_name>.k_pages[k_index]`."""
    asked = []
    engine.spec.gate.admits = lambda num_seqs: asked.append(num_seqs) or len(asked) > 1  # no, then yes
    runner = engine.runner
    pools = getattr(runner, pools_name)
    setattr(
        runner,
        pools_name,
        dataclasses.replace(
            pools, k_pages=tuple(jnp.full_like(k, jnp.nan) if i == k_index else k for i, k in enumerate(pools.k_pages))
        ),
    )

    def written(blocks) -> list[bool]:  # per block: the draft's K entries were written
        k = np.asarray(getattr(runner, pools_name).k_pages[k_index])[sorted(blocks)]
        return (~np.isnan(k.reshape(len(k), -1))).all(axis=1).tolist()

    def cached_pages() -> set[int]:  # (checkpoints are stored in the same arrays: not these)
        return set(engine.scheduler.cache.node_of_block)

    first, other = random_prompt(41, 1), random_prompt(41, 2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def generate(prompt):
        seq = engine.add_request(prompt, params)
        while engine.has_unfinished:
            engine.step()
        assert seq.output_token_ids == hf_greedy(model, prompt, 12)
        return seq

    assert not generate(first).speculates
    ready = engine.runner.steps.ready  # by shape key, the last entry: the step runs the draft
    assert ready and not any(key[-1] for key in ready)  # its steps were compiled without the draft
    pages = cached_pages()
    assert len(pages) == (41 + 12) // ARGS["page_size"] and not any(written(pages))
    again = generate(first)
    assert again.num_cached_tokens == 40 and not again.speculates
    assert asked == [1]  # a hit without the draft's state is not the gate's to decide
    assert not any(written(cached_pages())) and engine.spec.stats.verifies == 0
    assert generate(other).speculates
    assert any(key[-1] for key in ready)
    new = cached_pages() - pages
    assert len(new) >= 41 // ARGS["page_size"] and all(written(new)) and engine.spec.stats.verifies > 0
    stats = engine.stats()
    assert (stats["spec_requests_speculating"], stats["spec_requests_not_speculating"]) == (1, 2)
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("arch", [a if a == "bamba" else pytest.param(a, marks=pytest.mark.slow) for a in ARCHS])
def test_tokens_identical_with_and_without_speculation_whatever_the_drafts(tmp_path, arch):
    """Without speculation: the same engine given no drafts (its steps are then plain decode
    and prefill steps; the seeded test below compares with an engine built without it)."""
    save_tiny_model(arch, tmp_path)
    llm = LLM(tmp_path, speculative_config=NGRAM, **ARGS)
    llm.engine.spec.propose = lambda seq, limit: []
    steps = set()  # (decode, verifies drafts, rows sampled per sequence) of each step run
    sample = llm.engine.runner.sample
    llm.engine.runner.sample = lambda batch, sampling, decode: (
        steps.add((decode, bool(np.any(sampling.num_drafts > 0)), sampling.sample_rows.shape[1])),
        sample(batch, sampling, decode),
    )[1]
    first = llm.generate(_prompts()[2:3], _params(0)[0], use_tqdm=False)[0].outputs[0].token_ids
    stop_id = first[5]  # a token the third prompt's output reaches
    want = _run(llm, stop_id)
    continuation = {tuple(p): o for p, (o, _) in zip(_prompts(), want)}
    assert any(reason == "stop" for _, reason in want)
    assert llm.stats()["spec_draft_tokens"] == 0

    llm.engine.spec.propose = llm.engine.spec.ngram_lookup
    assert _run(llm, stop_id) == want  # ngram drafts
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["tokens_hit"] > 0
    # Some drafts were verified in a verify step (no prefill: T = S * (k + 1), one-token updates).
    assert any(decode and t == s * (K + 1) for t, s, _, decode, *_ in llm.engine.runner.steps.ready)

    llm.engine.spec.propose = _oracle(continuation, wrong=False)
    before = llm.stats()
    assert _run(llm, stop_id) == want
    after = llm.stats()
    assert (
        after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        == (after["spec_draft_tokens"] - before["spec_draft_tokens"])
        > 0
    )  # every draft accepted
    assert {decode for decode, verifies, _ in steps if verifies} == {True, False}  # mixed steps too, beside a prefill
    # A step that verifies drafts samples k + 1 rows per sequence; one that verifies none,
    # decode or mixed, runs in a plain engine's shape.
    assert {(verifies, width) for _, verifies, width in steps} == {(False, 1), (True, K + 1)}

    llm.engine.spec.propose = _oracle(continuation, wrong=True)
    if llm.engine.scheduler.slots is not None:
        _poison_unread_slots(llm)
    before = llm.stats()
    assert _run(llm, stop_id) == want
    after = llm.stats()
    assert after["spec_accepted_tokens"] == before["spec_accepted_tokens"]  # none accepted
    assert after["spec_draft_tokens"] > before["spec_draft_tokens"]
    llm.engine.scheduler.check_invariants()


@pytest.fixture(scope="module")
def bamba_spec(tiny_models) -> LLM:
    return LLM(tiny_models["bamba"][0], speculative_config=NGRAM, **ARGS)


@pytest.mark.slow
def test_no_step_compiles_after_warm_up_while_speculating(tiny_models):
    """Warm-up compiles every verify shape: a workload of mixed prefill and verify steps,
    prefix hits and a long repeated prompt then compiles nothing."""
    llm = LLM(tiny_models["bamba"][0], speculative_config=NGRAM, **{**ARGS, "warm_up": True}, background_compile=False)
    compiled = llm.engine.runner.num_compiled_steps()
    _run(llm, stop_id=7)
    prompt = random_prompt(300, 7)
    llm.generate([prompt, prompt[:150]], SamplingParams(max_tokens=8, temperature=0.7, seed=1), use_tqdm=False)
    assert llm.stats()["spec_draft_tokens"] > 0
    assert llm.engine.runner.num_compiled_steps() == compiled, "a step compiled after warm-up"


@pytest.mark.slow  # seeded sampling through verify steps: also in test_mtp.py's tokens test, fast
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(tiny_models, bamba_spec):
    """Each verify row draws its output index with the request's key for that index, so a
    seeded request samples the same tokens (temperature, top-k, top-p; and greedy) as an
    engine without speculation, whatever is accepted."""
    params = [
        SamplingParams(max_tokens=12, temperature=t, seed=s, top_k=k, top_p=p, ignore_eos=True)
        for t, s, k, p in ((0.8, 1, 0, 1.0), (0.8, 2, 20, 1.0), (0.8, 3, 0, 0.7), (0.0, 4, 0, 1.0))
    ]
    prompts = _prompts()[:4]
    want = [
        o.outputs[0].token_ids for o in LLM(tiny_models["bamba"][0], **ARGS).generate(prompts, params, use_tqdm=False)
    ]
    continuation = {tuple(p): o for p, o in zip(prompts, want)}
    bamba_spec.engine.spec.propose = _oracle(continuation, wrong=False)  # right after the first token
    try:
        assert [o.outputs[0].token_ids for o in bamba_spec.generate(prompts, params, use_tqdm=False)] == want
    finally:
        bamba_spec.engine.spec.propose = bamba_spec.engine.spec.ngram_lookup
    assert bamba_spec.stats()["spec_accepted_tokens"] > 0


def test_a_repeated_prompt_hits_under_speculation_on_the_first_repeat(bamba_spec):
    prompt = random_prompt(300, 7)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, second = (bamba_spec.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
    assert second.num_cached_tokens >= 272 and second.outputs[0].token_ids == first.outputs[0].token_ids


def test_accepted_tokens_follow_the_target_distribution():
    """The rule applied to one position: a draft d is kept when the target's own draw equals
    it, else the draw is emitted. Over many draws the emitted token must follow p (chi-square)."""
    rng = np.random.default_rng(0)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    draws = rng.choice(len(p), size=(6000, 2), p=p)  # the target's draws after the pending token and the draft
    for draft in (0, 3):
        first = np.array([accept([draft], list(row))[0] for row in draws])
        observed = np.bincount(first, minlength=len(p))
        chi2 = ((observed - 6000 * p) ** 2 / (6000 * p)).sum()
        assert chi2 < 20.5, (draft, observed)  # 5 degrees of freedom, p-value 0.001


def test_accept_keeps_the_agreeing_prefix_and_the_target_token_after_it():
    assert accept([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted, then the bonus token
    assert accept([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the first disagreement ends it
    assert accept([4, 5, 6], [1, 5, 6, 7]) == [1]
    assert accept([], [3]) == [3]


def _lookup(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    return NgramIndex(lookup_min, lookup_max).propose(tokens, k)


def test_ngram_lookup_continues_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 6, 1, 2, 3]
    assert _lookup(tokens, 2, 1, 3) == [8, 7]  # suffix 1 2 3: its latest earlier occurrence
    assert _lookup(tokens, 5, 1, 3) == [8, 7, 6, 1, 2]
    assert _lookup([1, 2, 3, 4], 3, 1, 3) == []  # no repeat
    assert _lookup([5, 1, 4, 2, 5], 3, 1, 3) == [1, 4, 2]  # only the 1-gram matches
    assert _lookup([5, 1, 4, 2, 5], 3, 2, 3) == []  # below prompt_lookup_min
    assert _lookup([7, 7, 7], 2, 1, 3) == [7]  # the suffix 7 7 matches at 0 and ends before the last token


def _brute_force_lookup(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup by its definition: for n from the longest down, the latest i + n < len
    with tokens[i:i+n] the last n tokens; the k tokens after it."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[-n:]:
                return tokens[i + n : i + n + k]
    return []


@settings(max_examples=examples(200), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    k=st.integers(0, 5),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_ngram_lookup_kept_up_to_date_matches_the_definition(tokens, cuts, k, bounds):
    """One index, looked up as the tokens grow by uneven amounts (none, one, many), proposes
    at every length what the definition proposes."""
    lookup_min, lookup_max = bounds[0], bounds[0] + bounds[1]
    index = NgramIndex(lookup_min, lookup_max)
    for end in sorted(cuts) + [len(tokens)]:
        end = min(end, len(tokens))
        assert index.propose(tokens[:end], k) == _brute_force_lookup(tokens[:end], k, lookup_min, lookup_max)


@pytest.mark.parametrize(
    "config, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 40}, "max_num_batched_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": -1}, "prompt_lookup_max"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngram", "model": "/nowhere", "num_speculative_tokens": 2}, "model"),
        ("ngram", "mapping"),
    ],
)
def test_bad_speculative_config_is_refused_before_loading(config, field, tmp_path):
    with pytest.raises(ValueError, match="speculative_config") as err:
        LLM(tmp_path / "no_model_here", speculative_config=config, **ARGS)  # fails before reading the model
    assert field in str(err.value)


def test_ngram_lookup_bounds_default_as_in_vllm():
    def bounds(**given) -> tuple[int, int]:
        config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, **given}, 16)
        return config.prompt_lookup_min, config.prompt_lookup_max

    assert bounds() == (5, 5)
    assert bounds(prompt_lookup_max=4) == (4, 4)
    assert bounds(prompt_lookup_min=2) == (2, 2)
    assert bounds(prompt_lookup_min=2, prompt_lookup_max=4) == (2, 4)


def test_speculative_config_in_a_yaml_engine_section(tmp_path):
    def config(spec) -> str:
        path = tmp_path / "run.yaml"
        path.write_text(
            yaml.safe_dump(
                {
                    "model": str(tmp_path),
                    "engine": {"speculative_config": spec},
                    "input": str(tmp_path / "in.jsonl"),
                    "output": "o",
                    "metrics": "m",
                }
            )
        )
        (tmp_path / "in.jsonl").write_text('{"prompt": "x"}\n')
        (tmp_path / "config.json").write_text("{}")
        return path

    assert load_run_config(config(NGRAM)).engine.speculative().num_speculative_tokens == K
    with pytest.raises(ConfigError, match="speculative_config.num_speculative_tokens"):
        load_run_config(config({"method": "ngram", "num_speculative_tokens": 0}))


def test_the_gate_drafts_only_while_verify_steps_emit_more_tokens_per_second_than_decode_steps():
    gate = SpeculationGate(probe_every=4, smoothing=0.5, max_probe_every=8)
    assert not gate.may_open_next(16)  # drafts made a step ahead (MTP): none before the decode timing
    assert not gate.open(16)  # a plain decode step first, to time it
    gate.record_decode(16, 0.010)  # 100 tokens/s per sequence
    assert gate.may_open_next(16)
    assert gate.open(16)  # then a verify step
    gate.record_verify(16, 0.030, emitted_per_seq=1.5)  # 50 tokens/s per sequence: does not pay
    ahead, opened = [], []
    for _ in range(21):
        ahead.append(gate.may_open_next(16))
        opened.append(gate.open(16))
    # Probes after 4 steps off, then 8 (the wait doubles up to max_probe_every), then 8 again.
    probes = [i for i, o in enumerate(opened) if o]
    assert probes == [3, 11, 19]
    assert [i for i, a in enumerate(ahead) if a] == probes  # drafts are made ahead of each probe only
    assert not gate.open(4)  # another batch size is timed on its own
    for _ in range(6):
        gate.record_verify(16, 0.030, emitted_per_seq=4.0)  # acceptance rose: 133 tokens/s
    assert [gate.may_open_next(16) for _ in range(2)] == [True, True]  # predicting does not move it
    # On: every 4th step (probe_every) is a plain one, re-timing decode.
    opened, retiming = [], []
    for _ in range(8):
        opened.append(gate.open(16))
        retiming.append(gate.retiming)
    assert opened == [True, True, True, False] * 2
    assert retiming == [not o for o in opened]  # a step that must not draft for the next (MTP) to be timed
    gate.record_decode(16, 0.005)  # decode got cheaper (e.g. shorter contexts): 200 tokens/s
    gate.record_decode(16, 0.005)
    gate.record_decode(16, 0.005)
    assert not gate.open(16)


def test_a_verify_step_pays_by_the_share_of_its_sequences_that_draft():
    """A verify step costs the same however many of its sequences draft: at 2.2 times a
    decode step's time, with 3 tokens per drafting sequence, it pays with every sequence
    drafting (3 tokens a sequence) or 60% of them (2.2), not with 40% (1.8)."""
    gate = SpeculationGate(probe_every=4, max_probe_every=8)
    gate.record_decode(16, 0.010)
    gate.record_verify(16, 0.022, emitted_per_seq=3.0)
    assert gate.pays(16) and gate.pays(16, share=0.6) and not gate.pays(16, share=0.4)
    assert gate.open(16)
    opened = [gate.open(16, share=0.4) for _ in range(12)]
    assert [i for i, o in enumerate(opened) if o] == [3, 11]  # probes only, after 4 steps off, then 8


def test_probes_wait_per_batch_size_and_a_probe_without_drafts_leaves_the_wait():
    """A run's few steps at another batch size (its first step, its last ones) do not reset
    the wait between probes; a probe due at a step without drafts verifies nothing and does
    not double the wait (the next comes a wait later, so ngram's lookups stay rare)."""
    gate = SpeculationGate(probe_every=4, max_probe_every=16)
    gate.record_decode(16, 0.010)
    gate.record_verify(16, 0.030, emitted_per_seq=1.5)  # does not pay
    assert [gate.open(16) for _ in range(4)] == [False, False, False, True]  # a probe after 4 steps off; the wait now 8
    gate.record_decode(1, 0.005)
    assert gate.open(1)  # at one sequence verify steps are not timed yet: it verifies
    assert not any(gate.open(16, share=0.0) for _ in range(10))  # nothing to verify: no probe (one was due at the 8th)
    opened = [gate.open(16) for _ in range(12)]
    assert [i for i, o in enumerate(opened) if o] == [5]  # 8 after the 8th step without drafts: the wait still 8


def test_ngram_verifies_only_where_enough_sequences_have_drafts(tiny_models):
    """Prompt lookup finds drafts for some sequences and not others; a verify step costs the
    same either way, so with the step times below it pays only where both sequences of the
    batch have drafts (3 tokens a sequence against 2.2 decode steps' time) and the engine
    decodes plainly where one has (2 tokens)."""
    llm = LLM(tiny_models["bamba"][0], speculative_config={**NGRAM, "adaptive": True}, **ARGS)
    engine = llm.engine
    for s in engine.builder.seq_buckets:
        engine.spec.gate.record_decode(s, 0.010)
        engine.spec.gate.record_verify(s, 0.022, emitted_per_seq=3.0)
    engine.spec.gate.record_decode = engine.spec.gate.record_verify = lambda *args, **kwargs: (
        None
    )  # the times above stay
    prompts = [random_prompt(25, seed) for seed in (1, 2, 3)]
    finds = [prompts[0], prompts[2]]  # prompt lookup finds drafts for these
    engine.spec.propose = lambda seq, limit: [1] * limit if seq.tokens[:25] in finds else []
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want = [hf_greedy(tiny_models["bamba"][1], p, 10) for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params, use_tqdm=False)] == want[:2]
    assert llm.stats()["spec_verifies"] == 0  # one of two sequences has drafts: never verified
    assert [o.outputs[0].token_ids for o in llm.generate(finds, params, use_tqdm=False)] == [want[0], want[2]]
    assert llm.stats()["spec_verifies"] > 0  # both have: verified


def test_the_gate_times_every_decode_and_verify_step_but_a_shapes_first(tiny_models):
    """An executable's first run is several times slower than its next ones: the engine does
    not hand the gate that step's time, and hands it every other decode and verify step's."""
    llm = LLM(tiny_models["bamba"][0], speculative_config={**NGRAM, "adaptive": True}, **ARGS)
    engine = llm.engine
    for s in engine.builder.seq_buckets:  # verify steps pay: the gate opens wherever drafts are
        engine.spec.gate.record_decode(s, 0.010)
        engine.spec.gate.record_verify(s, 0.001, emitted_per_seq=3.0)
    engine.spec.propose = lambda seq, limit: [1] * limit
    keys, timed = [], []  # each step's executable key; the steps (1-based) whose time the gate got
    sample = engine.runner.sample
    engine.runner.sample = lambda batch, sampling, decode: (
        keys.append(shape_key(batch, sampling, decode)) or sample(batch, sampling, decode)
    )
    engine.spec.gate.record_decode = engine.spec.gate.record_verify = lambda *args, **kwargs: timed.append(len(keys))
    prompts = [random_prompt(25, seed) for seed in (1, 2, 3)]
    llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    first = {keys.index(k) + 1 for k in set(keys)}
    decode = {i + 1 for i, k in enumerate(keys) if k[3]}
    assert llm.stats()["spec_verifies"] > 0 and decode - first
    assert sorted(timed) == sorted(decode - first)


def test_one_slow_step_does_not_keep_the_gate_on():
    """A pause of the host can make a step take several times its usual time; after a few
    more steps the gate decides on the usual times."""
    gate = SpeculationGate(probe_every=4, max_probe_every=8)
    gate.record_decode(16, 0.050)  # a pause: 5x the usual decode step
    for _ in range(3):
        gate.record_verify(16, 0.025, emitted_per_seq=2.0)  # 80 tokens/s per sequence
    assert gate.pays(16)  # against the one slow decode step it seems to
    gate.record_decode(16, 0.010)  # the usual decode step: 100 tokens/s per sequence
    gate.record_decode(16, 0.010)
    assert not gate.pays(16)
    assert not gate.open(16)


def test_the_gate_admits_requests_to_speculate_only_where_verify_steps_beat_plain_decode_steps():
    """Per request (the MTP method): speculate until verify steps are timed, then not until
    plain decode steps (no MTP pass) are timed, then where verify steps emit more tokens per
    second than plain decode steps by the margin, else only every `wait`-th admission (a
    probe), the wait S times as long at S sequences (a probe there makes all S pay the
    module's pass)."""
    gate = SpeculationGate(probe_every=2, max_probe_every=4, admit_margin=0.2)
    for s in (1, 4):
        assert gate.admits(s)  # nothing timed: speculate, to time verify steps
        gate.record_decode(s, 0.010, plain=False)  # a decode step with the MTP pass
        gate.record_verify(s, 0.020, emitted_per_seq=2.2)  # 110 tokens/s per sequence against 100: pays
        assert gate.pays(s)
        assert not gate.admits(s)  # plain decode steps not timed yet: admit without, to time them
        gate.record_decode(s, 0.008, plain=True)  # 125 tokens/s per sequence: speculating does not pay
        assert gate.pays(s)  # for a sequence that speculates already (it pays the pass anyway)
    admitted = [gate.admits(1) for _ in range(9)]
    assert [i for i, a in enumerate(admitted) if a] == [1, 5]  # probes after 2 admissions off, then 4
    admitted = [gate.admits(4) for _ in range(30)]
    assert [i for i, a in enumerate(admitted) if a] == [7, 23]  # at 4 sequences: after 8, then 16
    gate.record_verify(1, 0.016, emitted_per_seq=2.2)  # verify steps got cheaper: 137.5 tokens/s
    gate.record_verify(1, 0.016, emitted_per_seq=2.2)
    assert gate.pays(1)  # they beat plain's 125 tokens/s, but not by 20%: a probe, then off again
    assert [gate.admits(1) for _ in range(4)] == [True, False, False, False]
    for _ in range(3):
        gate.record_verify(1, 0.012, emitted_per_seq=2.2)  # 183 tokens/s
    assert all(gate.admits(1) for _ in range(3))
    assert gate.admits(16)  # another batch size is timed on its own


def test_acceptance_at_one_batch_size_does_not_decide_another():
    """Each bucket keeps its own tokens per verify step: a run at one sequence that accepts
    every draft does not make verify steps at 16 look as if they paid."""
    gate = SpeculationGate(admit_margin=0.2)
    gate.record_decode(16, 0.010, plain=True)
    gate.record_verify(16, 0.025, emitted_per_seq=2.0)  # 80 tokens/s per sequence against 100
    assert not gate.admits(16) and not gate.pays(16)
    for _ in range(20):
        gate.record_verify(1, 0.003, emitted_per_seq=3.0)  # every draft accepted at one sequence
    assert gate.emitted_per_seq[16] == 2.0
    assert not gate.admits(16) and not gate.pays(16)


def test_adaptive_is_on_by_default_and_must_be_a_bool():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}, 64).adaptive
    with pytest.raises(ValueError, match="speculative_config.adaptive"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "yes"}, 64)


def test_a_backoff_counts_the_steps_it_could_not_try_in():
    """ngram's per-sequence lookup backoff: steps in which a lookup could not run (its token
    unread, the gate shut) count toward the wait but never spend a try."""
    off = ProbeBackoff(first=4, longest=16)
    assert [off.due() for _ in range(4)] == [False, False, False, True]  # every 4th, then the wait doubles
    for _ in range(20):
        off.tick()  # 20 steps without a chance: the count stops one short of the wait (8)
    assert off.due(commit=False) and off.due()
    assert not off.due() and off.wait == 16
