"""Tensor parallelism over the test run's eight CPU devices (`tests/conftest.py`): greedy
tokens equal one device's, with a prefix hit in the workload; every weight and pool lies
where the sharding table says; bad parallel arguments are refused before anything loads."""

import dataclasses
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jaxengine import LLM, SamplingParams
from jaxengine.engine import engine_setup
from jaxengine.engine.mesh import Parallelism
from jaxengine.models.arch import load_model_config
from jaxengine.models.loader import load_model
from jaxengine.models.param_store import save_params
from tests.engine.test_pool_donation import assert_no_step_copies_a_pool
from tests.models.tiny_models import ARCHS, hf_greedy, random_prompt, save_tiny_model

ARGS = dict(
    max_model_len=128, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, warm_up=False, compilation_cache_dir=None
)
SHARED = random_prompt(40, 1)
# The second request shares the first's 36-token prefix: a hit of 32 tokens (8 pages).
PROMPTS = ([SHARED], [SHARED[:36] + random_prompt(9, 2), random_prompt(17, 3)])
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (model directory, its transformers model), made once per module."""
    made = {}

    def get(arch: str):
        if arch not in made:
            path = tmp_path_factory.mktemp(arch)
            made[arch] = (path, save_tiny_model(arch, path))
        return made[arch]

    return get


def _check_tokens(models, arch: str, sizes: list[int], **kwargs) -> None:
    """Greedy tokens at each tensor-parallel size equal transformers' (a no-cache greedy loop,
    as one device's are), the second round hitting the first's prefix."""
    path, hf_model = models(arch)
    want = [hf_greedy(hf_model, prompt, MAX_TOKENS) for prompt in PROMPTS[0] + PROMPTS[1]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for tp in sizes:
        llm = LLM(path, tensor_parallel_size=tp, **ARGS, **kwargs)
        first = llm.generate(PROMPTS[0], params, use_tqdm=False)
        second = llm.generate(PROMPTS[1], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first + second] == want, tp
        assert second[0].num_cached_tokens >= 32, tp


def test_bamba_tokens_at_tp2_are_those_of_one_device(models):
    _check_tokens(models, "bamba", [2])


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "bamba"])
def test_tokens_at_tp2_and_tp4_are_those_of_one_device(models, arch):
    _check_tokens(models, arch, [2, 4])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["granite_moe", "qwen3_5_moe", "jamba"])
def test_expert_parallel_tokens_are_those_of_one_device(models, arch):
    _check_tokens(models, arch, [2, 4], enable_expert_parallel=True)


def _specs(llm: LLM) -> dict[str, tuple]:
    """Each parameter's partition spec by its path, e.g. 'layers/1/mixer/q_proj/kernel'."""
    runner = llm.engine.runner
    params = jax.tree.unflatten(runner.param_treedef, runner.param_leaves)
    paths = [
        jax.tree_util.keystr(p, simple=True, separator="/").removesuffix("/value")
        for p, _ in jax.tree_util.tree_leaves_with_path(params)
    ]
    return {path: tuple(leaf.sharding.spec) for path, leaf in zip(paths, runner.param_leaves)}


# (path fragment, spec at TP 4 over the tiny Bamba: 4 query heads, 2 KV heads (replicated
# at TP 4), 8 Mamba heads, vocabulary 128).
BAMBA_TP4 = [
    ("embed", ("model", None)),
    ("lm_head/kernel", (None, "model")),
    ("q_proj/kernel", (None, "model")),
    ("k_proj/kernel", (None, None)),
    ("v_proj/kernel", (None, None)),
    ("o_proj/kernel", ("model", None)),
    ("gate_proj/kernel", (None, "model")),
    ("up_proj/kernel", (None, "model")),
    ("down_proj/kernel", ("model", None)),
    ("in_proj/kernel", (None, "model")),
    ("conv_weight", ("model", None)),
    ("A_log", ("model",)),
    ("dt_bias", ("model",)),
    ("out_proj/kernel", ("model", None)),
    ("mamba/norm/weight", ("model",)),
    ("mixer_norm/weight", (None,)),
    ("final_norm/weight", (None,)),
]


def _padded(spec: tuple, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def test_weights_and_pools_lie_where_the_table_says(models):
    path = models("bamba")[0]
    llm = LLM(path, tensor_parallel_size=4, **ARGS)
    runner = llm.engine.runner
    specs = _specs(llm)
    for fragment, want in BAMBA_TP4:
        found = {p: s for p, s in specs.items() if p.endswith(fragment)}
        assert found, fragment
        for p, got in found.items():
            assert _padded(got, len(want)) == want, (p, got)
    # KV pages [blocks, page, kv_heads, head_dim]: 2 KV heads are copied to each of 4 devices.
    for pages in runner.pools.k_pages + runner.pools.v_pages:
        assert _padded(pages.sharding.spec, 4) == (None, None, None, None)
    # Live states [slots, heads or channels, ...]: split by head.
    for layer in runner.pools.states:
        for pool in layer:
            assert _padded(pool.sharding.spec, pool.ndim)[:2] == (None, "model"), pool.shape
    # Device 0 holds a quarter of every split array, all of every replicated one.
    device0 = jax.devices()[0]
    split = [a for a in runner.param_leaves + jax.tree.leaves(runner.pools) if "model" in tuple(a.sharding.spec)]
    assert len(split) > 10
    held = sum(s.data.nbytes for a in split for s in a.addressable_shards if s.device == device0)
    assert held * 4 == sum(a.nbytes for a in split)


def test_kv_pages_split_by_kv_head_when_the_devices_divide_them(models):
    llm = LLM(models("bamba")[0], tensor_parallel_size=2, **ARGS)
    pools = llm.engine.runner.pools
    assert all(_padded(p.sharding.spec, 4) == (None, None, "model", None) for p in pools.k_pages + pools.v_pages)
    assert _specs(llm)["layers/1/attention/k_proj/kernel"] == (None, "model")


@pytest.mark.slow
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "prefill"])
def test_no_tensor_parallel_step_copies_a_pool(models, decode):
    """Steps of four sequences. A one-sequence decode step at TP 2 copies one K pool on
    XLA:CPU (the page gather fused with the page write); not yet resolved."""
    assert_no_step_copies_a_pool(LLM(models("bamba")[0], tensor_parallel_size=2, **ARGS).engine, decode, (4,))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide the model's num_attention_heads=4"),
        (dict(tensor_parallel_size=16), "tensor_parallel_size=16 exceeds the 8 cpu devices"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
        (dict(enable_expert_parallel=True), "enable_expert_parallel=True: the model has no mixture-of-experts"),
    ],
)
def test_bad_parallel_arguments_are_refused_before_loading(models, monkeypatch, kwargs, message):
    def not_loaded(*args, **kw):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_setup, "load_model", not_loaded)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(models("bamba")[0], **ARGS, **kwargs)


def test_kv_heads_neither_dividing_nor_divided_are_refused(models):
    """4 query heads and 2 KV heads: TP 4 copies the KV heads; 3 KV heads split over neither."""
    cfg = load_model_config(models("llama")[0])
    Parallelism(4).validate(cfg)
    odd = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, num_heads=6, num_kv_heads=3))
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads=6"):
        Parallelism(4).validate(odd)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the model's num_key_value_heads=3"):
        Parallelism(2).validate(odd)


def test_converted_parameters_are_restored_into_their_shards(models, tmp_path):
    """A `jaxengine convert`ed checkpoint comes back from Orbax already split (no whole copy on
    one device), each parameter in the sharding the table gives it, equal to the original."""
    path, _ = models("bamba")
    _, _, state = load_model(path)
    shutil.copy(path / "config.json", tmp_path)
    save_params(state, tmp_path)
    place = Parallelism(4).placement(load_model_config(tmp_path))
    restored = load_model(tmp_path, place=place)[2]
    variables = jax.tree.leaves(restored, is_leaf=lambda x: isinstance(x, nnx.Variable))
    split = 0
    for var, want in zip(variables, jax.tree.leaves(state)):
        value = var.get_value()
        assert isinstance(value, jax.Array) and value.sharding == place(var)
        np.testing.assert_array_equal(np.asarray(value), want)
        split += value.sharding.shard_shape(value.shape) != value.shape
    assert split > len(variables) // 2  # most are split four ways
