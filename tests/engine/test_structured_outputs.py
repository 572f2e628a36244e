"""Structured outputs: outputs follow JSON schemas, regexes, choices and Lark grammars with
a model that would never write them unconstrained; the mask is applied before sampling
(greedy picks the best allowed token, draws follow the renormalised distribution, logprobs
are of the masked one), no request compiles a step, and bad grammars are refused by field."""

import json
import math
import re

import jsonschema
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxengine import LLM, SamplingParams
from jaxengine.run_config import DEFAULT_MODEL
from jaxengine.sampling_params import StructuredOutputsParams

PROMPT = "def parse(text):\n    "  # a Python model: it writes code, never JSON on its own


@pytest.fixture(scope="module")
def llm():
    with LLM(DEFAULT_MODEL, max_model_len=512, warm_up=False, compilation_cache_dir=None) as llm:
        yield llm


def digits(llm: LLM) -> list[int]:
    """The token ids whose text is one decimal digit (from the tokenizer alone)."""
    tok = llm.get_tokenizer()
    return [t for t in range(llm.engine.model_config.vocab_size) if re.fullmatch(r"[0-9]", tok.decode([t]))]


def run(llm: LLM, so: StructuredOutputsParams, n: int = 4, max_tokens: int = 96, seed: int = 0) -> list:
    params = SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=so)
    return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs


def test_unconstrained_the_model_writes_no_json(llm):
    free = llm.generate([PROMPT], SamplingParams(n=4, max_tokens=40, seed=0), use_tqdm=False)[0].outputs
    for c in free:
        with pytest.raises(json.JSONDecodeError):
            json.loads(c.text)


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "tags", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
        },
        "required": ["point", "code"],
        "additionalProperties": False,
    },
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "nested"])
def test_json_schema_outputs_validate(llm, schema):
    outs = run(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True), n=6)
    finished = [c for c in outs if c.finish_reason == "stop"]
    assert len(finished) >= 4, [c.text for c in outs]
    for c in finished:
        jsonschema.validate(json.loads(c.text), schema)
    for c in outs:
        assert c.finish_reason in ("stop", "length")  # a document cut short says so


# Small schemas drawn at random: a flat object of typed, enumerated and patterned fields.
FIELD = st.sampled_from(
    [
        {"type": "integer", "minimum": -5, "maximum": 500},
        {"type": "boolean"},
        {"enum": ["red", "green", 7]},
        {"type": "string", "pattern": "^[a-z]{1,4}$"},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        {"type": "number", "minimum": -10, "maximum": 10},
        {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"enum": ["p", "q"]}},
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        {
            "type": "array",
            "items": {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]},
            "maxItems": 2,
        },
    ]
)


@settings(max_examples=6, deadline=None)
@given(st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), FIELD, min_size=1, max_size=3), st.integers(0, 1000))
def test_drawn_schemas_validate(llm, fields, seed):
    schema = {"type": "object", "properties": fields, "required": sorted(fields), "additionalProperties": False}
    for c in run(llm, StructuredOutputsParams(json=schema, disable_any_whitespace=True), n=2, seed=seed):
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
        else:
            assert c.finish_reason == "length"


def test_regex_choice_grammar_and_json_object(llm):
    pattern = r"[0-9]{3}-[a-z]{2,5}"
    for c in run(llm, StructuredOutputsParams(regex=pattern)):
        assert c.finish_reason == "stop" and re.fullmatch(pattern, c.text)
    choices = ["yes", "no", "maybe later"]
    for c in run(llm, StructuredOutputsParams(choice=choices)):
        assert c.finish_reason == "stop" and c.text in choices
    lark = 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[1-9][0-9]?/'
    for c in run(llm, StructuredOutputsParams(grammar=lark), max_tokens=60):
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", c.text), c.text
    for c in run(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), n=4):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)


def test_greedy_picks_the_best_allowed_token_and_logprobs_are_masked(llm):
    allowed = digits(llm)
    logits = llm.prompt_logits(llm.get_tokenizer().encode(PROMPT))[-1]
    masked = np.full_like(logits, -np.inf)
    masked[allowed] = logits[allowed]
    want = int(np.argmax(masked))
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=2, structured_outputs={"regex": "[0-9]"})
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [want]
    assert want != int(np.argmax(logits))  # the mask changed the choice
    log_z = np.log(np.sum(np.exp(masked[allowed] - masked[want]))) + masked[want]
    assert out.logprobs[0][want].logprob == pytest.approx(masked[want] - log_z, abs=1e-4)


def test_draws_follow_the_masked_distribution(llm):
    allowed = digits(llm)
    logits = llm.prompt_logits(llm.get_tokenizer().encode(PROMPT))[-1].astype(np.float64)
    p = np.exp(logits[allowed] - logits[allowed].max())
    p /= p.sum()
    params = [
        SamplingParams(n=50, max_tokens=1, temperature=1.0, seed=1000 * i, structured_outputs={"regex": "[0-9]"})
        for i in range(12)
    ]
    outs = llm.generate([PROMPT] * 12, params, use_tqdm=False)
    drawn = [c.token_ids[0] for o in outs for c in o.outputs]
    assert set(drawn) <= set(allowed)
    counts = np.array([drawn.count(t) for t in allowed], float)
    expected = p * len(drawn)
    keep = expected >= 5  # chi-square over the cells with enough mass, the rest pooled
    observed = np.append(counts[keep], counts[~keep].sum())
    expect = np.append(expected[keep], expected[~keep].sum())
    observed, expect = observed[expect > 0], expect[expect > 0]
    chi2 = float(np.sum((observed - expect) ** 2 / expect))
    df = len(observed) - 1
    assert chi2 < df + 4 * math.sqrt(2 * df) + 10, (chi2, df)  # far past p = 0.001 only if the draw is wrong


def test_no_step_compiles_for_grammars(llm):
    """The same batch without and then with grammars: the second compiles nothing."""
    plain = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=0, ignore_eos=True)
    llm.generate([PROMPT, "x = "], plain, use_tqdm=False)
    before = llm.engine.runner.num_compiled_steps()
    constrained = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=0, structured_outputs={"regex": "[a-z]{40}"})
    for c in llm.generate([PROMPT, "x = "], constrained, use_tqdm=False)[0].outputs:
        assert re.fullmatch("[a-z]+", c.text)
    assert llm.engine.runner.num_compiled_steps() == before


@pytest.mark.parametrize(
    "so, field",
    [
        ({"json": {"type": "bogus"}}, "structured_outputs.json"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"regex": "[a-"}, "structured_outputs.regex"),
        ({"grammar": "start: ("}, "structured_outputs.grammar"),
        ({"choice": []}, "structured_outputs.choice"),
        ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
        ({"regexp": "a"}, "structured_outputs"),
    ],
)
def test_bad_grammars_are_refused_by_field_before_queueing(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["ok", PROMPT], [SamplingParams(), SamplingParams(structured_outputs=so)], use_tqdm=False)
    assert not llm.engine.has_unfinished


def test_stop_strings_and_samples_with_a_grammar(llm):
    params = SamplingParams(
        n=6,
        max_tokens=16,
        temperature=1.0,
        seed=5,
        stop=[" beta"],
        structured_outputs={"choice": ["alpha beta", "gamma"]},
    )
    outs = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs
    assert len(outs) == 6
    assert all(c.text in ("alpha", "gamma") and c.finish_reason == "stop" for c in outs), [c.text for c in outs]


def test_yaml_requests_take_structured_outputs(tmp_path):
    from jaxengine.run_config import ConfigError, load_requests, load_run_config

    lines = [
        {"prompt": "a", "structured_outputs": {"regex": "[0-9]+"}},
        {"prompt": "b"},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(
        f"model: default\nsampling: {{structured_outputs: {{choice: [x, y]}}}}\n"
        f"input: {tmp_path / 'in.jsonl'}\noutput: {tmp_path / 'out.jsonl'}\nmetrics: {tmp_path / 'm.json'}\n"
    )
    requests = load_requests(load_run_config(cfg_path))
    assert requests[0].params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    assert requests[1].params.structured_outputs == StructuredOutputsParams(choice=["x", "y"])
    (tmp_path / "in.jsonl").write_text(json.dumps({"prompt": "a", "structured_outputs": {"regexp": "1"}}) + "\n")
    with pytest.raises(ConfigError, match=r"in\.jsonl:1.*regexp"):
        load_requests(load_run_config(cfg_path))


@pytest.mark.slow
def test_a_speculating_engine_serves_grammars_without_speculating_them():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    with LLM(
        DEFAULT_MODEL, warm_up=False, max_model_len=256, speculative_config=spec, compilation_cache_dir=None
    ) as llm:
        params = SamplingParams(n=3, max_tokens=24, temperature=1.0, seed=2, structured_outputs={"regex": "[a-z]{4,8}"})
        for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs:
            assert c.finish_reason == "stop" and re.fullmatch("[a-z]{4,8}", c.text)
        stats = llm.stats()
        assert stats["spec_requests_speculating"] == 0 and stats["spec_verifies"] == 0


@pytest.mark.slow
def test_grammars_under_preemption_and_without_prefix_caching(llm):
    """A pool too small for the batch preempts and recomputes sequences: their matchers go on
    from the outputs they keep, and the tokens are those of an engine that never preempts."""
    params = SamplingParams(
        n=8, max_tokens=80, temperature=1.0, seed=9, structured_outputs={"regex": "[a-z ]{150,200}"}
    )
    want = [c.token_ids for c in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs]
    tight = dict(num_cache_blocks=14, enable_prefix_caching=False, max_model_len=256, compilation_cache_dir=None)
    with LLM(DEFAULT_MODEL, warm_up=False, **tight) as small:
        outs = small.generate([PROMPT], params, use_tqdm=False)[0].outputs
        assert small.stats()["preemptions"] > 0
    assert [c.token_ids for c in outs] == want
    assert all(re.fullmatch("[a-z ]{150,200}", c.text) for c in outs if c.finish_reason == "stop")


class _Refusing:
    """A matcher whose grammar takes no token."""

    def consume_token(self, token: int) -> bool:
        return False

    def get_error(self) -> str:
        return "no token allowed here"


def test_a_grammar_that_takes_no_token_ends_the_sample(llm):
    from jaxengine.engine.sequence import Sequence

    seq = Sequence("r", 0, [1, 2, 3], 3, SamplingParams(max_tokens=8), 0, matcher=_Refusing())
    llm.engine.outputs.append(seq, 7, None)
    assert seq.output_token_ids == [] and seq.finish_reason == "abort"
    assert "no token allowed here" in seq.stop_reason
