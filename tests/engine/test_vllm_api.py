"""vLLM's offline API on the embedded default model (it has a tokenizer): output shapes, `n`,
stop strings, sampling-parameter defaults, `chat`, and vLLM's engine arguments."""

import json
import logging
import shutil

import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine import vllm_args
from jaxengine.run_config import DEFAULT_MODEL

ARGS = dict(
    max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, enforce_eager=True, compilation_cache_dir=None
)
PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(DEFAULT_MODEL), **ARGS)


def test_outputs_are_shaped_as_vllms(llm: LLM):
    out = llm.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))  # one prompt, no list
    assert len(out) == 1
    out = out[0]
    assert out.prompt == PROMPT and out.prompt_token_ids == llm.get_tokenizer().encode(PROMPT)
    assert out.finished and out.prompt_logprobs is None and len(out.outputs) == 1
    sample = out.outputs[0]
    assert sample.index == 0 and len(sample.token_ids) == 5 and sample.finish_reason == "length"
    assert sample.text == llm.get_tokenizer().decode(sample.token_ids)
    assert sample.stop_reason is None and sample.cumulative_logprob is None and sample.logprobs is None
    same = llm.generate({"prompt": PROMPT}, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    ids = llm.generate(
        {"prompt_token_ids": out.prompt_token_ids}, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    )[0]
    assert same.outputs[0].token_ids == ids.outputs[0].token_ids == sample.token_ids
    assert ids.prompt is None  # given as ids


def test_n_samples_share_the_prompts_cached_pages(llm: LLM):
    before = llm.stats()["tokens_hit"]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    out = llm.generate([PROMPT + "    # one\n"], params)[0]
    num_prompt = len(out.prompt_token_ids)
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # three different samples
    # Samples 1 and 2 start from sample 0's pages: every full page but the one holding the last token.
    assert llm.stats()["tokens_hit"] - before >= 2 * ((num_prompt - 1) // 16) * 16 > 0
    # As vLLM seeds sample j with seed + j: sample 1 is the seed-12 draw of the prompt.
    alone = llm.generate(
        [PROMPT + "    # one\n"], SamplingParams(max_tokens=6, temperature=1.0, seed=12, ignore_eos=True)
    )
    assert alone[0].outputs[0].token_ids == out.outputs[1].token_ids


def test_a_multi_character_stop_string_is_matched_whole(llm: LLM):
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    text = llm.generate(PROMPT, greedy)[0].outputs[0].text
    stop = next(text[i : i + 2] for i in range(1, len(text) - 1) if text[i : i + 2] not in text[: i + 1])
    cut = text.index(stop)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop))[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        PROMPT,
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]
    token = llm.generate(PROMPT, greedy)[0].outputs[0].token_ids[2]
    by_id = llm.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[token]))[0].outputs[0]
    assert by_id.stop_reason == token and by_id.token_ids[-1] == token


def test_sampling_params_defaults_and_clone_follow_vllm():
    p = SamplingParams(stop=None, stop_token_ids=None, max_tokens=None, seed=-1)
    assert p.stop == () and p.stop_token_ids == () and p.max_tokens is None and p.seed is None
    p.validate()
    q = p.clone()
    q.temperature = 0.5
    assert p.temperature == 1.0 and q.temperature == 0.5
    with pytest.raises(ValueError, match="SamplingParams.n must be an integer"):
        SamplingParams(n=0).validate()
    with pytest.raises(ValueError, match="SamplingParams.prompt_logprobs must be an integer"):
        SamplingParams(prompt_logprobs=-3).validate()
    with pytest.raises(ValueError, match="SamplingParams.truncate_prompt_tokens must be an integer"):
        SamplingParams(truncate_prompt_tokens=0).validate()


def test_default_sampling_params_come_from_generation_config(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7}))
    llm = LLM(str(model), **ARGS)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens, defaults.top_k) == (0.6, 0.9, 7, 0)
    assert len(llm.generate("x = 1\n")[0].outputs[0].token_ids) <= 7  # generate without params uses them


def test_chat_renders_the_template_and_tokenizes_once(llm: LLM, monkeypatch):
    conversation = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Add two numbers."}]
    out = llm.chat(conversation, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), chat_template=TEMPLATE)
    rendered = "### system:\nYou write Python.\n### user:\nAdd two numbers.\n### assistant:\n"
    assert out[0].prompt == rendered
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    direct = llm.generate(rendered, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert out[0].outputs[0].token_ids == direct.outputs[0].token_ids
    two = llm.chat([conversation, conversation[1:]], SamplingParams(max_tokens=2), chat_template=TEMPLATE)
    assert len(two) == 2 and two[1].prompt.startswith("### user:")
    # The embedded model's own template (Python comments) when none is given.
    own = llm.chat(conversation, SamplingParams(max_tokens=1))[0].prompt
    assert own == "<|endoftext|># system: You write Python.\n# user: Add two numbers.\n# assistant:\n"
    monkeypatch.setattr(llm.get_tokenizer(), "chat_template", None)  # a model without one
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat(conversation)


def test_vllm_engine_arguments_are_taken_or_refused_by_name(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(vllm_args, "_logged", set())  # each is logged once per process
    with caplog.at_level(logging.INFO, logger="jaxengine"):
        llm = LLM(
            str(DEFAULT_MODEL),
            **ARGS,
            trust_remote_code=True,
            swap_space=4,
            tensor_parallel_size=1,
            block_size=8,
            gpu_memory_utilization=0.5,
            dtype="float",
            seed=3,
            kv_cache_dtype="auto",
            tokenizer=str(DEFAULT_MODEL),
        )
    assert llm.engine.config.page_size == 8 and llm.engine.config.dtype == "float32"
    assert not llm.engine.config.warm_up  # enforce_eager
    assert "trust_remote_code=True has no effect" in caplog.text
    assert "gpu_memory_utilization has no effect on cpu" in caplog.text
    for bad, match in [
        (dict(pipeline_parallel_size=2), "pipeline_parallel_size must be 1"),
        (dict(tensor_parallel_size=64), "tensor_parallel_size=64 exceeds the 8 cpu devices"),
        (dict(quantization="awq"), "quantization must be None"),
        (dict(dtype="float64"), "dtype must be one of auto, float32"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be a number in \(0, 1\]"),
        (dict(block_size=8, page_size=8), "give engine argument 'block_size' or 'page_size', not both"),
        (dict(max_num_seq=4), "unknown engine argument 'max_num_seq'; known: .*and vLLM's .*block_size"),
    ]:
        with pytest.raises(ValueError, match=match):
            LLM(str(DEFAULT_MODEL), **{**ARGS, **bad})


def test_half_precision_is_refused_for_recurrent_models_and_served_for_transformers(tiny_models):
    with pytest.raises(ValueError, match="dtype='float16' is not supported for models with recurrent layers"):
        LLM(tiny_models["bamba"][0], dtype="half", **ARGS)
    llama = LLM(tiny_models["llama"][0], dtype="half", **ARGS)
    assert llama.engine.runner.param_leaves[0].dtype == "float16"
    ref = LLM(tiny_models["llama"][0], **ARGS)  # "auto": the checkpoint's float32
    assert ref.engine.config.dtype == "float32"
    ids = [3, 9, 27, 81, 5, 7, 11]
    half, full = llama.prompt_logits(ids), ref.prompt_logits(ids)
    # float16 keeps 11 significant bits: about 1e-3 of the logits' scale per operation.
    np.testing.assert_allclose(half, full, atol=5e-3 * np.abs(full).max())
    assert np.abs(half - full).max() > 0  # it did compute in half precision


def test_bad_words_allowed_token_ids_and_logit_bias_are_masks_in_the_compiled_step(llm: LLM):
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = llm.generate(PROMPT, greedy)[0].outputs[0]
    compiled = llm.engine.runner.num_compiled_steps()
    tok = llm.get_tokenizer()
    word = next(w for w in plain.text.split() if w.isidentifier() and len(tok.encode(w)) >= 1)
    variants = [tok.encode(w, add_special_tokens=False) for w in (word, " " + word)]

    def contains(ids: list[int], sub: list[int]) -> bool:
        return any(ids[i : i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))

    assert any(contains(plain.token_ids, v) for v in variants)
    banned = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, bad_words=[word]))[
        0
    ].outputs[0]
    assert not any(contains(banned.token_ids, v) for v in variants) and banned.token_ids != plain.token_ids
    allowed = sorted(set(plain.token_ids[5:]))
    only = llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=0, ignore_eos=True, allowed_token_ids=allowed)
    )[0].outputs[0]
    assert set(only.token_ids) <= set(allowed)
    forced = llm.generate(
        PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={allowed[0]: 100.0})
    )[0].outputs[0]
    assert forced.token_ids == [allowed[0]] * 6
    assert llm.engine.runner.num_compiled_steps() == compiled  # the same step shapes: no recompile


def test_mask_parameters_are_checked_by_name():
    for params, match in [
        (SamplingParams(logit_bias={10**7: 1.0}), "SamplingParams.logit_bias must map token ids in the vocabulary"),
        (SamplingParams(allowed_token_ids=[]), "SamplingParams.allowed_token_ids must be a non-empty list"),
        (SamplingParams(allowed_token_ids=list(range(300))), "allowed_token_ids may hold at most 256"),
        (SamplingParams(bad_words=[" "]), "SamplingParams.bad_words must be a list of non-blank strings"),
    ]:
        with pytest.raises(ValueError, match=match):
            params.validate(vocab_size=4096)


def test_reset_prefix_cache_and_truncate_prompt_tokens(llm: LLM):
    params = SamplingParams(max_tokens=2)
    llm.generate(PROMPT * 2, params)
    assert llm.generate(PROMPT * 2, params)[0].num_cached_tokens > 0
    assert llm.reset_prefix_cache()
    assert llm.stats()["checkpoints_held"] == 0
    assert llm.generate(PROMPT * 2, params)[0].num_cached_tokens == 0
    ids = llm.get_tokenizer().encode(PROMPT)
    cut = llm.generate(PROMPT, SamplingParams(max_tokens=2, truncate_prompt_tokens=5))[0]
    assert cut.prompt_token_ids == ids[-5:]
