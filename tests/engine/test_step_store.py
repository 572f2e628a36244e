"""Step executables stored on disk: a second engine loads them instead of compiling."""

import gc
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine import step_store
from tests.engine.fresh_process import last_line

# One token bucket and one sequence bucket: three step shapes, quick to compile.
ARGS = dict(max_model_len=64, page_size=4, max_num_seqs=1, max_num_batched_tokens=16, background_compile=False)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _tokens(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _count_compiles(monkeypatch, *, fail: bool = False) -> dict:
    real = jax.stages.Lowered.compile
    calls = {"n": 0}

    def counted(self, *args, **kwargs):
        calls["n"] += 1
        if fail:
            raise AssertionError("compiled although the store holds the executable")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    return calls


@pytest.fixture(scope="module")
def stored(tiny_models, tmp_path_factory):
    """A store filled by one warmed-up engine, and that engine's tokens; the engine stays
    alive meanwhile (a process must not load a second copy of an executable it holds)."""
    directory = tmp_path_factory.mktemp("store")
    llm = LLM(tiny_models["bamba"][0], compilation_cache_dir=str(directory), **ARGS)
    yield directory, len(llm.engine.shapes()), _tokens(llm)
    del llm


def test_every_shape_is_stored(stored):
    directory, num_shapes, _ = stored
    assert len(list((directory / "steps").glob("*.bin"))) == num_shapes


def test_a_second_engine_loads_every_step_and_gives_the_same_tokens(tiny_models, stored, monkeypatch):
    directory, num_shapes, tokens = stored
    _count_compiles(monkeypatch, fail=True)
    llm = LLM(tiny_models["bamba"][0], compilation_cache_dir=str(directory), **ARGS)
    assert llm.engine.runner.num_compiled_steps() == num_shapes
    assert _tokens(llm) == tokens
    assert llm.engine.runner.num_compiled_steps() == num_shapes  # nothing compiled during the run


# Fills or reads a store in a fresh process (a process loads files only until it compiles a
# step itself): prints how many steps it compiled and its tokens.
IN_A_FRESH_PROCESS = """
import sys, jax
from jaxengine import LLM, SamplingParams
compiles = []
real = jax.stages.Lowered.compile
jax.stages.Lowered.compile = lambda self, *a, **k: compiles.append(1) or real(self, *a, **k)
llm = LLM(sys.argv[1], **eval(sys.argv[2]))
out = llm.generate([eval(sys.argv[3])], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
print(len(compiles), out[0].outputs[0].token_ids)
"""


def _fresh_process(model, args: dict) -> tuple[int, list[int]]:
    compiles, tokens = last_line(IN_A_FRESH_PROCESS, str(model), repr(args), repr(PROMPT)).split(" ", 1)
    return int(compiles), eval(tokens)


@pytest.mark.slow
def test_a_fresh_process_loads_the_store_and_compiles_a_damaged_file_again(tiny_models, tmp_path):
    model = tiny_models["bamba"][0]
    args = {**ARGS, "compilation_cache_dir": str(tmp_path)}
    num_compiles, tokens = _fresh_process(model, args)  # fills the store
    assert num_compiles == 3
    assert _fresh_process(model, args) == (0, tokens)  # a warm start: every step loaded
    files = sorted((tmp_path / "steps").glob("*.bin"))
    files[0].write_bytes(b"not an executable")
    assert _fresh_process(model, args) == (1, tokens)
    assert _tokens(LLM(model, **{**args, "compilation_cache_dir": None})) == tokens


def test_the_key_changes_with_the_code_and_the_shapes(monkeypatch):
    store = step_store.StepStore(None)
    a = jax.ShapeDtypeStruct((4,), "int32")
    key = store.key({"decode": True}, a)
    assert store.key({"decode": False}, a) != key
    assert store.key({"decode": True}, jax.ShapeDtypeStruct((8,), "int32")) != key
    monkeypatch.setattr(step_store, "_source_digest", lambda: "other code")
    assert store.key({"decode": True}, a) != key


def test_models_that_differ_only_in_settings_get_their_own_steps(tiny_models, stored, tmp_path):
    """Same parameter shapes, another constant baked into the step (the norm epsilon): the
    engine must not run the stored executable of the first model."""
    directory, _, tokens = stored
    model = tiny_models["bamba"][0]
    other = tmp_path / "other_eps"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 0.5
    (other / "config.json").write_text(json.dumps(config))
    want = _tokens(LLM(other, **{**ARGS, "compilation_cache_dir": None}))
    assert want != tokens  # the setting does change the outputs
    assert _tokens(LLM(other, compilation_cache_dir=str(directory), **ARGS)) == want


def test_the_key_names_the_devices():
    """A data-parallel replica's steps have its shapes on other devices: another program."""
    store = step_store.StepStore(None)
    devices = jax.devices()
    here = jax.ShapeDtypeStruct((4,), "int32", sharding=jax.sharding.SingleDeviceSharding(devices[0]))
    there = jax.ShapeDtypeStruct((4,), "int32", sharding=jax.sharding.SingleDeviceSharding(devices[2]))
    assert store.key({}, here) != store.key({}, there)
    mesh = [jax.sharding.Mesh(devices[i : i + 2], ("tp",)) for i in (0, 2)]
    split = [
        jax.ShapeDtypeStruct((4,), "int32", sharding=jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec("tp")))
        for m in mesh
    ]
    assert store.key({}, split[0]) != store.key({}, split[1])


@pytest.fixture
def store_of_other_shapes(tiny_models, tmp_path, monkeypatch):
    """A store filled by an engine that is gone, every file holding the executable of one
    shape (so each other shape loads and fails when run); the process may load from it."""
    args = {**ARGS, "max_model_len": 48, "compilation_cache_dir": str(tmp_path)}
    llm = LLM(tiny_models["bamba"][0], **args)
    tokens = _tokens(llm)
    llm.shutdown()
    del llm
    step_store.forget_shared_steps()
    gc.collect()
    files = sorted((tmp_path / "steps").glob("*.bin"))
    for path in files[1:]:
        path.write_bytes(files[0].read_bytes())
    monkeypatch.setattr(step_store, "_loading_allowed", True)
    return args, tokens, files


def test_a_stored_step_that_fails_when_run_is_compiled_again_and_replaced(tiny_models, store_of_other_shapes, caplog):
    args, tokens, files = store_of_other_shapes
    wrong = files[0].read_bytes()
    llm = LLM(tiny_models["bamba"][0], **args)
    with caplog.at_level("WARNING", logger="jaxengine.engine.step_executables"):
        assert _tokens(llm) == tokens
    steps = llm.engine.runner.steps
    assert steps.recompiled_after_failure >= 1
    assert sum("failed at its first run" in r.getMessage() for r in caplog.records) == steps.recompiled_after_failure
    assert sum(path.read_bytes() != wrong for path in files) == steps.recompiled_after_failure  # replaced


def test_a_stored_step_that_fails_after_taking_the_pools_loses_one_step_only(
    tiny_models, store_of_other_shapes, monkeypatch
):
    """As XLA:CPU's own failure does ("NOT_FOUND: Function ... not found" when the outputs are
    read): the step ran, took the pools and failed; the engine recovers and goes on."""
    args, tokens, files = store_of_other_shapes
    for path in files:  # every file right again: the failure is the one below
        path.unlink()
    llm = LLM(tiny_models["bamba"][0], **args)
    want = _tokens(llm)
    assert want == tokens
    llm.shutdown()
    step_store.forget_shared_steps()
    gc.collect()
    real_load = step_store.StepStore.load
    pools_taken = []

    def failing_after_the_run(self, key):
        executable = real_load(self, key)
        if executable is None:
            return None

        def run(**kwargs):
            executable(**kwargs)  # donates the pools
            pools_taken.append(all(leaf.is_deleted() for leaf in jax.tree.leaves(kwargs["pools"])))
            raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion.3 not found")

        run.input_shardings = executable.input_shardings  # what the runner asks a step for
        return run

    monkeypatch.setattr(step_store.StepStore, "load", failing_after_the_run)
    monkeypatch.setattr(step_store, "_loading_allowed", True)  # the engine above compiled
    llm = LLM(tiny_models["bamba"][0], **args)
    assert _tokens(llm) == tokens
    assert llm.engine.runner.steps.recompiled_after_failure >= 1
    assert pools_taken and all(pools_taken)  # each failing step ran and took the pools first


# A program with its own JAX code that serves from a shared store, in a fresh process.
PROGRAM = """
import sys, jax, jax.numpy as jnp
x = jnp.arange(600.0).reshape(60, 10)
own = float(jax.jit(lambda x, i: jnp.tanh(x[i]).sum() * jnp.cumsum(x).max())(x, jnp.array([1, 7, 30 + len(sys.argv[2])])))
from jaxengine import LLM, SamplingParams
llm = LLM(sys.argv[1], **eval(sys.argv[2]))
out = llm.generate([eval(sys.argv[3])], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
print(out[0].outputs[0].token_ids)
"""


def test_programs_that_share_a_store_in_turn_give_the_tokens_of_no_store(tiny_models, stored, tmp_path):
    """Two programs with different settings and JAX code of their own fill one store (the
    default one, under their home), a third loads from it; tokens as without a store."""
    model = tiny_models["bamba"][0]
    other = dict(ARGS, max_model_len=48)
    env = {**os.environ, "HOME": str(tmp_path)}
    got = [last_line(PROGRAM, str(model), repr(args), repr(PROMPT), env=env) for args in (ARGS, other, ARGS)]
    want = stored[2], _tokens(LLM(model, **{**other, "compilation_cache_dir": None}))
    assert [eval(tokens) for tokens in got] == [want[0], want[1], want[0]]
    assert len(list((tmp_path / ".cache" / "jaxengine" / "xla" / "steps").glob("*.bin"))) == 6  # 3 shapes each


def test_a_stored_executable_loads_onto_the_devices_it_was_made_for(tmp_path, monkeypatch):
    """A data-parallel replica's step runs on devices 2 and 3 (here in the order 3, 2)."""
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array([devices[3], devices[2]]), ("tp",))
    x = jax.device_put(np.arange(8.0), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("tp")))
    store = step_store.StepStore(tmp_path)
    key = store.key({}, x)
    store.save(key, jax.jit(lambda x: x * 2).lower(x).compile())
    step_store.forget_shared_steps()
    gc.collect()
    monkeypatch.setattr(step_store, "_loading_allowed", True)
    loaded = store.load(key)
    assert loaded is not None
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.arange(8.0) * 2)
