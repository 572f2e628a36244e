"""A Gated DeltaNet model (tiny Qwen3.5) through the engine: after warm-up no step compiles,
whatever mix of prefills, decodes, prefix hits and checkpoint saves it runs."""

import jax
import pytest

from jaxengine import LLM, SamplingParams
from tests.models.tiny_models import random_prompt, save_tiny_model

ARGS = dict(
    max_model_len=64,
    page_size=4,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    background_compile=False,
    compilation_cache_dir=None,
)


@pytest.mark.slow
def test_no_step_compiles_after_warm_up(tmp_path, monkeypatch):
    save_tiny_model("qwen3_5", tmp_path)
    llm = LLM(tmp_path, **ARGS)
    steps = llm.engine.runner.steps
    assert len(steps.ready) == len(llm.engine.shapes())

    def refuse(*args, **kwargs):
        raise AssertionError("a step compiled after warm-up")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)
    shared = random_prompt(21, 1)
    prompts = [shared + random_prompt(n, n) for n in (1, 9, 30)] + [random_prompt(3, 4), shared]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert sum(o.num_cached_tokens for o in again) > 0  # the second round hits checkpoints
    assert steps.compiled_on_demand == 0
