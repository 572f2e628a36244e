"""Step executables stored on disk: a second engine loads them instead of compiling."""

import json
import shutil
import subprocess
import sys

import jax
import pytest

from jaxengine import LLM, SamplingParams
from jaxengine.engine import step_store

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
    run = subprocess.run([sys.executable, "-c", IN_A_FRESH_PROCESS, str(model), repr(args), repr(PROMPT)],
                         check=True, capture_output=True, text=True, timeout=600)
    compiles, tokens = run.stdout.strip().splitlines()[-1].split(" ", 1)
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
