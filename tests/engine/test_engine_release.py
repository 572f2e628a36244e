"""An engine gives back what it holds when it is freed (`del`, `shutdown()`, `with`): its step
executables and the memory maps behind them, its device arrays, its background compile; what
the process keeps for later engines is bounded."""

import gc

import jax
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine import step_store
from tests.engine.fresh_process import last_line

# Token bucket 16, sequence buckets 1 and 2: seven step shapes, two compiled before serving
# and five left to the background thread (the defaults: warm-up with background compiles).
ARGS = dict(max_model_len=96, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, compilation_cache_dir=None)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# Creates and frees five engines in a fresh process and prints its memory maps after each, and
# how many executables the process keeps. A fresh process: a test worker that ran other modules
# holds thousands of mappings already, whose count moves with what those left behind.
CYCLES = """
import gc, sys, weakref
from pathlib import Path
from jaxengine import LLM, SamplingParams
from jaxengine.engine import step_store
maps = []
for _ in range(5):
    llm = LLM(sys.argv[1], **eval(sys.argv[2]))
    llm.generate([eval(sys.argv[3])], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    engine = weakref.ref(llm.engine)
    del llm
    gc.collect()
    assert engine() is None, "the background thread held on to the engine"
    maps.append(len(Path("/proc/self/maps").read_text().splitlines()))
print((maps, step_store.num_kept_steps()))
"""


def test_freed_engines_give_back_their_memory_maps(tiny_models):
    model = tiny_models["bamba"][0]
    maps, kept = eval(last_line(CYCLES, str(model), repr(ARGS), repr(PROMPT)))
    assert max(maps[1:]) <= 1.1 * maps[0], maps
    assert kept <= step_store.KEPT_STEPS


@pytest.mark.parametrize("release", ["shutdown", "with"])
def test_a_shut_down_engine_holds_no_arrays_no_thread_and_refuses_requests(tiny_models, release):
    model = tiny_models["bamba"][0]
    if release == "with":
        with LLM(model, **ARGS) as llm:
            want = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    else:
        llm = LLM(model, **ARGS)
        want = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        llm.shutdown()
        llm.shutdown()  # a second call does nothing
    runner = llm.engine.runner
    arrays = [*runner.param_leaves, *jax.tree.leaves(runner.pools)]
    assert arrays and all(a.is_deleted() for a in arrays)
    assert not runner.steps.ready and not runner.steps.compiling
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    # A new engine of equal settings starts from the executables the process kept, and its
    # tokens are those of the first.
    again = LLM(model, **ARGS)
    steps = again.engine.runner.steps
    assert len(set(steps.ready) - set(steps.compile_seconds)) >= 2  # the shapes it waited for: kept ones
    assert again.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
    again.shutdown()


def test_what_the_process_keeps_for_later_engines_is_bounded(monkeypatch):
    class Executable:  # stands for a compiled step (weakly referable, like one)
        pass

    monkeypatch.setattr(step_store, "_KEPT", type(step_store._KEPT)())
    monkeypatch.setattr(step_store, "KEPT_STEPS", 3)
    held = [Executable() for _ in range(5)]
    for i, executable in enumerate(held):
        step_store._share(f"k{i}", executable, keep=True)
    assert step_store.num_kept_steps() == 3
    assert step_store._shared("k0") is held[0]  # still held by someone: found, not kept
    del held
    gc.collect()
    assert [step_store._shared(f"k{i}") is not None for i in range(5)] == [False, False, True, True, True]
    step_store._share("background", Executable(), keep=False)  # not waited for: goes with its engine
    gc.collect()
    assert step_store._shared("background") is None and step_store.num_kept_steps() == 3
