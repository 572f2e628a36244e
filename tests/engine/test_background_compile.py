"""Serving while the background thread compiles: steps run in larger ready shapes meanwhile."""

import gc
import threading

import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine import step_executables, step_store
from jaxengine.engine.batch_builder import Shape

# Token bucket 16, sequence buckets 1 and 2: seven step shapes.
ARGS = dict(max_model_len=96, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, compilation_cache_dir=None)
PROMPTS = [[1 + (7 * i + j) % 50 for j in range(5 + 9 * i)] for i in range(3)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False}  # always drafting


# With speculation (verify shapes among those that wait): under `slow`, the plain case runs fast.
@pytest.mark.parametrize(
    "speculative_config", [None, pytest.param(NGRAM, marks=pytest.mark.slow)], ids=["plain", "ngram"]
)
def test_only_the_largest_shapes_wait_and_tokens_are_those_of_exact_shapes(
    tiny_models, monkeypatch, speculative_config
):
    """With speculation, the largest shapes that wait are verify shapes: steps that verify
    drafts, decode or mixed, fit only them."""
    step_store.forget_shared_steps()  # every shape compiled here, whatever ran before in this process
    gc.collect()
    gate = threading.Event()  # holds the background thread back until the first call is done
    compile_all = step_executables._compile_all
    monkeypatch.setattr(step_executables, "_compile_all", lambda owner: (gate.wait(), compile_all(owner)))
    try:
        # Warm-up with background compiles (the default).
        llm = LLM(tiny_models["bamba"][0], speculative_config=speculative_config, **ARGS)
        steps, shapes = llm.engine.runner.steps, llm.engine.shapes()
        assert len(steps.ready) < len(shapes)  # the rest was left to the background thread
        largest_mixed = max((s for s in shapes if not s.decode), key=lambda s: (s.num_tokens, s.num_seqs))
        width = 1 + (speculative_config or {}).get("num_speculative_tokens", 0)
        key = (largest_mixed.num_tokens, largest_mixed.num_seqs, largest_mixed.num_saves, False, width, False)
        assert key in steps.ready  # (without a drafter: neither has an MTP module or draft model)
        early = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]  # while shapes compile
        assert steps.compiled_on_demand == 0
        if speculative_config:
            assert llm.stats()["spec_draft_tokens"] > 0  # steps verified drafts
        assert llm.stats()["steps_in_larger_shapes"] > 0 and llm.stats()["step_shapes_not_ready"] > 0
    finally:
        gate.set()  # a failed check must not leave the thread (and the process's exit) waiting
    steps.wait()
    assert llm.stats()["step_shapes_not_ready"] == 0
    assert len(steps.ready) == len(shapes)
    assert set(steps.compile_seconds) == set(steps.ready) and min(steps.compile_seconds.values()) > 0  # all compiled
    assert [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ] == early  # every step its own shape


def test_a_step_fits_shapes_no_smaller_and_decode_fits_mixed():
    decode, mixed = Shape(4, 4, True, 1), Shape(16, 4, False, 8)
    assert mixed.covers(decode) and not decode.covers(mixed)
    assert Shape(4, 4, True, 4).covers(decode) and not Shape(4, 4, True, 0).covers(decode)
    assert not Shape(16, 1, False, 5).covers(Shape(16, 4, False, 8))
    verify = Shape(16, 4, False, 8, sample_width=3, num_position_states=8)  # a mixed step verifying 2 drafts
    assert verify.covers(mixed) and not mixed.covers(verify)
    assert verify.covers(Shape(12, 4, True, 1, sample_width=3, num_position_states=8))
    # With the MTP module or draft model: a step in which no sequence speculates (no drafter)
    # fits the drafter's shape, which skips it at run time; not the reverse.
    drafter = Shape(16, 4, False, 8, runs_drafter=True)
    assert drafter.covers(mixed) and not mixed.covers(drafter)
