"""Checkpoint loading: sharded and tied checkpoints, error messages, config quirks, Orbax.

Most tests start from a saved tiny Bamba model (attention and Mamba layers, so every kind of
tensor conversion), copy it, break one thing and check the error names it. Tests that run
the engine use the parity prompt length, so their step shapes are already compiled when the
whole directory runs.
"""

import copy
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import PreTrainedModel

from jaxengine import LLM
from jaxengine.cli import main
from jaxengine.models.arch import load_model_config
from jaxengine.models.loader import load_model
from jaxengine.models.param_store import CONVERTED_PARAMS_DIR, save_params
from tests.models.tiny_models import (
    ENGINE_ARGS,
    FLOAT32_ATOL,
    build_tiny_model,
    hf_logits,
    max_abs_diff,
    random_prompt,
    save_tiny_model,
)
from tests.models.tiny_mtp import add_tiny_mtp

PROMPT = random_prompt(29, seed=1)
SUPPORTED = (
    "LlamaForCausalLM",
    "Mamba2ForCausalLM",
    "BambaForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM",
    "Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Lfm2ForCausalLM",
    "FalconH1ForCausalLM",
    "Zamba2ForCausalLM",
    "JambaForCausalLM",
)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory) -> tuple[Path, PreTrainedModel]:
    """A saved tiny Bamba checkpoint (never modified) and its torch model."""
    path = tmp_path_factory.mktemp("bamba")
    return path, save_tiny_model("bamba", path)


@pytest.fixture
def bamba_copy(bamba, tmp_path) -> Path:
    """A private copy of the Bamba checkpoint that a test may break."""
    return Path(shutil.copytree(bamba[0], tmp_path / "model"))


def engine_logits(path: Path) -> np.ndarray:
    """float32 `prompt_logits` of `PROMPT` from a fresh engine on `path`."""
    return LLM(path, dtype="float32", **ENGINE_ARGS).prompt_logits(PROMPT)


def edit_tensors(path: Path, edit: Callable[[dict[str, np.ndarray]], None]) -> None:
    """Rewrites `path/model.safetensors` after `edit` changed its tensor dict in place."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    """Rewrites `path/config.json` after `edit` changed the parsed dict in place."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def flat_params(state: nnx.State) -> dict[str, np.ndarray]:
    """{"layers/0/mamba/A_log": array, ...} of a loaded parameter state."""
    leaves = jax.tree_util.tree_flatten_with_path(state.to_pure_dict())[0]
    return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(leaf) for path, leaf in leaves}


def assert_same_params(a: nnx.State, b: nnx.State) -> None:
    """Same parameter names, dtypes and bit-identical values."""
    fa, fb = flat_params(a), flat_params(b)
    assert fa.keys() == fb.keys()
    for name, value in fa.items():
        assert value.dtype == fb[name].dtype, name
        np.testing.assert_array_equal(value, fb[name], err_msg=name)


# ---------------------------------------------------------------------------- checkpoint layouts


@pytest.mark.parametrize("arch", ["bamba", "nemotron_h"])
def test_sharded_checkpoint_loads_like_single_file(arch, tmp_path):
    model = build_tiny_model(arch)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (sharded / "model.safetensors").exists()

    assert_same_params(load_model(sharded)[2], load_model(single)[2])
    logits = engine_logits(sharded)
    np.testing.assert_array_equal(logits, engine_logits(single))
    assert max_abs_diff(logits, hf_logits(model, PROMPT)) <= FLOAT32_ATOL


def test_a_bfloat16_checkpoint_loads_its_values_in_either_dtype(bamba, tmp_path):
    """Tensors stored in bfloat16 are read as such and widened exactly."""
    path, model = bamba
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)
    as_stored = load_file(tmp_path / "model.safetensors")
    assert {x.dtype.name for x in as_stored.values()} == {"bfloat16"}
    rounded = [np.asarray(x).astype(ml_dtypes.bfloat16) for x in jax.tree.leaves(load_model(path)[2])]
    for dtype in ("bfloat16", "float32"):
        leaves = jax.tree.leaves(load_model(tmp_path, dtype)[2])
        assert len(leaves) == len(rounded)
        for got, want in zip(leaves, rounded):
            np.testing.assert_array_equal(np.asarray(got), want.astype(dtype))


def test_tied_embeddings_match_hf(tmp_path):
    model = save_tiny_model("mamba2", tmp_path, tie=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    assert load_model_config(tmp_path).tie_word_embeddings
    assert max_abs_diff(engine_logits(tmp_path), hf_logits(model, PROMPT)) <= FLOAT32_ATOL


def test_converted_orbax_params_round_trip(bamba, tmp_path):
    """`save_params` output next to config.json loads bit-identically to the safetensors."""
    path, _ = bamba
    _, _, state = load_model(path)
    shutil.copy(path / "config.json", tmp_path)
    save_params(state, tmp_path)
    assert (tmp_path / CONVERTED_PARAMS_DIR).is_dir()
    assert not list(tmp_path.glob("*.safetensors"))

    assert_same_params(load_model(tmp_path)[2], state)
    np.testing.assert_array_equal(engine_logits(tmp_path), engine_logits(path))


def test_the_mtp_module_loads_when_asked_and_converts_with_the_model(tmp_path):
    """mtp.* tensors fill the MTP module's parameters only with `mtp=True` (else they are
    skipped); `jaxengine convert` stores them, and either load of the converted directory
    equals that of the safetensors. A missing MTP tensor is named."""
    src, out = tmp_path / "hf", tmp_path / "converted"
    add_tiny_mtp(save_tiny_model("bamba", src), src)
    cfg, _, with_mtp = load_model(src, mtp=True)
    assert cfg.mtp_layers and "mtp" in with_mtp.to_pure_dict()
    fc = load_file(src / "model.safetensors")["mtp.fc.weight"]
    np.testing.assert_array_equal(np.asarray(with_mtp.to_pure_dict()["mtp"]["fc"]["kernel"]), fc.T)
    cfg, _, without = load_model(src)
    assert not cfg.mtp_layers and "mtp" not in without.to_pure_dict()

    main(["convert", str(src), str(out)])
    assert_same_params(load_model(out, mtp=True)[2], with_mtp)
    assert_same_params(load_model(out)[2], without)

    tensors = load_file(src / "model.safetensors")
    tensors.pop("mtp.layers.0.self_attn.k_proj.weight")
    save_file(tensors, src / "model.safetensors")
    with pytest.raises(ValueError, match="mtp/layers/0/attention/k_proj/kernel"):
        load_model(src, mtp=True)


# ---------------------------------------------------------------------------- tensor errors


def _delete(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def _add(name: str, shape: tuple[int, ...]) -> Callable[[dict], None]:
    return lambda tensors: tensors.update({name: np.zeros(shape, np.float32)})


@pytest.mark.parametrize(
    "edit, message",
    [
        pytest.param(
            _delete("model.layers.0.mamba.A_log"),
            r"missing tensors for parameters layers/0/mamba/A_log$",
            id="missing",
        ),
        pytest.param(
            _add("model.layers.0.mamba.extra.weight", (4, 4)),
            r"unexpected tensor 'model\.layers\.0\.mamba\.extra\.weight' with shape \(4, 4\)",
            id="unknown-name",
        ),
        pytest.param(  # a well-formed name, but layer 0 is a Mamba layer and has no attention
            _add("model.layers.0.self_attn.q_proj.weight", (64, 64)),
            r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' \(no parameter layers/0/attention/q_proj/kernel\)",
            id="no-such-parameter",
        ),
        pytest.param(
            _add("model.layers.0.mamba.conv1d.weight", (192, 1, 3)),
            r"tensor 'model\.layers\.0\.mamba\.conv1d\.weight' has shape \(192, 1, 3\), expected \(192, 1, 4\)",
            id="misshaped-conv",
        ),
        pytest.param(
            _add("model.layers.1.self_attn.k_proj.weight", (64, 64)),
            r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(64, 64\), expected \(32, 64\)",
            id="misshaped-linear",
        ),
    ],
)
def test_bad_tensor_is_named(bamba_copy, edit, message):
    edit_tensors(bamba_copy, edit)
    with pytest.raises(ValueError, match=message):
        load_model(bamba_copy)


# ---------------------------------------------------------------------------- config errors


def test_unsupported_architecture_lists_supported(bamba_copy):
    edit_config(bamba_copy, lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: ") as err:
        load_model(bamba_copy)
    for name in SUPPORTED:
        assert name in str(err.value)


def _yarn(config: dict) -> None:
    config["rope_parameters"].update(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)


@pytest.mark.parametrize(
    "edit, message",
    [
        pytest.param(
            lambda c: c.update(hidden_act="gelu"),
            r"BambaForCausalLM: unsupported value hidden_act='gelu'; supported: silu",
            id="hidden_act",
        ),
        pytest.param(
            _yarn,
            r"BambaForCausalLM: unsupported value rope_parameters\.rope_type='yarn'; supported: 'default'",
            id="rope_type",
        ),
    ],
)
def test_unsupported_field_value_is_named(bamba_copy, edit, message):
    edit_config(bamba_copy, edit)
    with pytest.raises(ValueError, match=message):
        load_model(bamba_copy)


def test_lfm2_unsupported_layer_type_is_named(tmp_path):
    save_tiny_model("lfm2", tmp_path)
    edit_config(tmp_path, lambda c: c.update(layer_types=["conv", "sliding_attention", "conv"]))
    with pytest.raises(
        ValueError,
        match=r"Lfm2ForCausalLM: unsupported value layer_types='sliding_attention'; "
        r"supported: conv, full_attention",
    ):
        load_model(tmp_path)


def test_nemotron_h_mtp_layers_are_read_and_unsupported_ones_named(tmp_path):
    """Nemotron-H's MTP module: an attention layer, then feed-forward layers (its tensors under
    their own names: mtp.layers.0.eh_proj, mtp.layers.1.final_layernorm, ...)."""
    src = tmp_path / "hf"
    add_tiny_mtp(save_tiny_model("nemotron_h", src), src)
    cfg, _, state = load_model(src, mtp=True)
    assert [(spec.mixers, spec.ffn) for spec in cfg.mtp_layers] == [(("attention",), None), ((), "moe")]
    tensors = load_file(src / "model.safetensors")
    mtp = state.to_pure_dict()["mtp"]
    np.testing.assert_array_equal(np.asarray(mtp["fc"]["kernel"]), tensors["mtp.layers.0.eh_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(mtp["norm"]["weight"]), tensors["mtp.layers.1.final_layernorm.weight"])
    for edit, message in [
        (dict(num_nextn_predict_layers=2), r"num_nextn_predict_layers=2; supported: 0 or 1"),
        (
            dict(num_nextn_predict_layers=1, mtp_layers_block_type=["moe", "full_attention"]),
            r"mtp_layers_block_type=\['moe', 'full_attention'\]",
        ),
    ]:
        edit_config(src, lambda c, edit=edit: c.update(edit))
        with pytest.raises(ValueError, match=r"NemotronHForCausalLM: unsupported value " + message):
            load_model_config(src)


def test_lfm2_feed_forward_width_is_auto_adjusted(tmp_path):
    """intermediate_size=128 -> int(2 * 128 / 3) = 85, rounded up to block_multiple_of=16: 96
    (what transformers builds: the checkpoint's w1 has 96 rows)."""
    model = save_tiny_model("lfm2", tmp_path)
    assert model.model.layers[0].feed_forward.w1.weight.shape[0] == 96
    assert load_model_config(tmp_path).mlp.intermediate_size == 96
    edit_config(tmp_path, lambda c: c.update(block_auto_adjust_ff_dim=False))
    assert load_model_config(tmp_path).mlp.intermediate_size == 128


def test_unsupported_dtypes_are_rejected(bamba):
    path, _ = bamba
    with pytest.raises(ValueError, match=r"unsupported dtype='float64'; supported: float32, bfloat16, float16"):
        load_model(path, "float64")
    with pytest.raises(ValueError, match=r"dtype='float16' is not supported for models with recurrent layers"):
        LLM(path, dtype="float16", **ENGINE_ARGS)


# ---------------------------------------------------------------------------- config quirks


@pytest.mark.parametrize("arch", ["mamba2", "bamba"])
def test_time_step_limit_with_encoded_infinity(arch, tmp_path):
    """save_pretrained writes the infinite upper limit as {"__float__": "Infinity"}."""
    save_tiny_model(arch, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["time_step_limit"]
    assert written == [0.0, {"__float__": "Infinity"}]
    assert load_model_config(tmp_path).mamba.time_step_limit == (0.0, math.inf)


@pytest.mark.parametrize(
    "limit, expected",
    [
        ([0.0, {"__float__": "Infinity"}], (0.0, math.inf)),
        ([0.0, math.inf], (0.0, math.inf)),
        ([0.01, 5.0], (0.01, 5.0)),
    ],
)
def test_time_step_limit_forms(bamba_copy, limit, expected):
    """The limit as HF encodes it, as a bare JSON `Infinity`, and finite."""
    edit_config(bamba_copy, lambda c: c.update(time_step_limit=limit))
    assert load_model_config(bamba_copy).mamba.time_step_limit == expected


# ---------------------------------------------------------------------------- broken files


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_are_named(bamba_copy, bad):
    def poison(tensors):
        tensors["model.layers.0.mamba.D"] = np.full_like(tensors["model.layers.0.mamba.D"], bad)

    edit_tensors(bamba_copy, poison)
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.0\.mamba\.D' holds NaN or infinite values"):
        load_model(bamba_copy)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "model.safetensors.index.json"])
def test_a_broken_file_is_named(bamba_copy, name):
    if name == "model.safetensors.index.json":
        (bamba_copy / name).write_text("{not json")
    else:
        (bamba_copy / name).write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match=re_escape_path(bamba_copy / name)):
        load_model(bamba_copy)


def test_a_broken_tokenizer_is_named(bamba_copy):
    from jaxengine.engine.tokenizer import load_tokenizer

    (bamba_copy / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match=re_escape_path(bamba_copy / "tokenizer.json")):
        load_tokenizer(bamba_copy)


def re_escape_path(path: Path) -> str:
    return re.escape(str(path))


def test_falcon_h1_multiplier_lists_of_the_wrong_length_are_named(tmp_path):
    save_tiny_model("falcon_h1", tmp_path)
    edit_config(tmp_path, lambda c: c.update(ssm_multipliers=[1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(
        ValueError,
        match=r"FalconH1ForCausalLM: unsupported value ssm_multipliers=\[1\.0, 1\.0, 1\.0, "
        r"1\.0\]; supported: a list of 5 numbers",
    ):
        load_model(tmp_path)


def test_falcon_h1_multipliers_are_folded_into_the_projections(tmp_path):
    """The loaded key projection is the checkpoint's times attention_in_multiplier (its
    input) and key_multiplier (its output); its bias only by key_multiplier; the Mamba2
    input projection's dt columns by ssm_in_multiplier and the last of ssm_multipliers."""
    model = save_tiny_model("falcon_h1", tmp_path)
    hf_cfg = model.config
    attn, mamba = model.model.layers[0].self_attn, model.model.layers[0].mamba
    _, _, state = load_model(tmp_path)
    params = state.to_pure_dict()["layers"][0]
    k_kernel = attn.k_proj.weight.detach().numpy().T * hf_cfg.attention_in_multiplier * hf_cfg.key_multiplier
    np.testing.assert_allclose(params["attention"]["k_proj"]["kernel"], k_kernel, rtol=1e-6)
    np.testing.assert_allclose(
        params["attention"]["k_proj"]["bias"], attn.k_proj.bias.detach().numpy() * hf_cfg.key_multiplier, rtol=1e-6
    )
    heads = hf_cfg.mamba_n_heads
    dt_rows = mamba.in_proj.weight.detach().numpy()[-heads:].T
    want = dt_rows * hf_cfg.ssm_in_multiplier * hf_cfg.ssm_multipliers[4]
    np.testing.assert_allclose(params["mamba"]["in_proj"]["kernel"][:, -heads:], want, rtol=1e-6)


def test_a_stored_falcon_h1_mup_vector_is_not_loaded(tmp_path):
    """Some checkpoints carry the muP vector; it is computed from the config instead."""
    save_tiny_model("falcon_h1", tmp_path)
    without = load_model(tmp_path)[2].to_pure_dict()["layers"][0]["mamba"]["in_proj"]["kernel"]
    edit_tensors(tmp_path, _add("model.layers.0.mamba.mup_vector", (1, 1, 264)))  # zeros: would zero in_proj
    with_it = load_model(tmp_path)[2].to_pure_dict()["layers"][0]["mamba"]["in_proj"]["kernel"]
    np.testing.assert_array_equal(with_it, without)


def test_zamba2_attention_adapters_need_as_many_kv_heads_as_heads(tmp_path):
    save_tiny_model("zamba2", tmp_path)
    edit_config(tmp_path, lambda c: c.update(num_key_value_heads=2))
    with pytest.raises(
        ValueError,
        match=r"Zamba2ForCausalLM: unsupported value num_key_value_heads=2; "
        r"supported: num_attention_heads=4",
    ):
        load_model(tmp_path)


def test_zamba2_shared_blocks_load_once_and_adapters_per_use(tmp_path):
    """Layers 1, 3 and 4 use blocks 0, 1, 0: the checkpoint stores block 0 under layer 1 and
    block 1 under layer 3 (layer 4's is tied to layer 1's); adapter list entry j is the j-th
    use's, whichever layer's block holds it."""
    model = save_tiny_model("zamba2", tmp_path)
    cfg, _, state = load_model(tmp_path)
    assert [spec.shared_block for spec in cfg.layers] == [None, 0, None, 1, 0]
    params = state.to_pure_dict()
    assert sorted(params["shared_blocks"]) == [0, 1]
    hf_layers = model.model.layers
    np.testing.assert_array_equal(
        params["shared_blocks"][1]["attention"]["q_proj"]["kernel"],
        hf_layers[3].shared_transformer.self_attn.q_proj.weight.detach().numpy().T,
    )
    third_use = hf_layers[1].shared_transformer.self_attn.linear_k_adapter_list[2][1].weight  # [out, rank]
    np.testing.assert_array_equal(params["layers"][4]["shared_use"]["k"]["up"]["kernel"], third_use.detach().numpy().T)


def _fuse_jamba_experts(tensors: dict[str, np.ndarray]) -> None:
    """Per-expert tensors (as transformers saves them) -> the fused layout it holds in memory:
    experts.gate_up_proj [E, 2I, H] and experts.down_proj [E, H, I]."""
    for name in [n for n in tensors if n.endswith("experts.0.gate_proj.weight")]:
        prefix = name.removesuffix("0.gate_proj.weight")
        count = len([n for n in tensors if n.startswith(prefix) and n.endswith(".gate_proj.weight")])
        gate_up = [
            np.concatenate([tensors.pop(f"{prefix}{e}.gate_proj.weight"), tensors.pop(f"{prefix}{e}.up_proj.weight")])
            for e in range(count)
        ]
        tensors[prefix + "gate_up_proj"] = np.stack(gate_up)
        tensors[prefix + "down_proj"] = np.stack([tensors.pop(f"{prefix}{e}.down_proj.weight") for e in range(count)])


def test_jamba_experts_load_from_either_layout(tmp_path):
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    model = save_tiny_model("jamba", per_expert)
    model.save_pretrained(fused)
    edit_tensors(fused, _fuse_jamba_experts)
    assert_same_params(load_model(fused)[2], load_model(per_expert)[2])


def test_jamba_dt_rank_auto_is_hidden_over_16_rounded_up(tmp_path):
    save_tiny_model("jamba", tmp_path)
    assert load_model_config(tmp_path).mamba1.dt_rank == 4  # ceil(64 / 16)
    edit_config(tmp_path, lambda c: c.update(mamba_dt_rank=6))
    assert load_model_config(tmp_path).mamba1.dt_rank == 6
