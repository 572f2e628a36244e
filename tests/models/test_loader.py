"""Checkpoint loading: sharded and tied checkpoints, error messages, config quirks, Orbax.

Most tests start from a saved tiny Bamba model (attention and Mamba layers, so every kind of
tensor conversion), copy it, break one thing and check the error names it. Tests that run
the engine use the parity prompt length, so their step shapes are already compiled when the
whole directory runs.
"""

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import PreTrainedModel

from jaxengine import LLM
from jaxengine.cli import main
from jaxengine.models.config import load_model_config
from jaxengine.models.loader import CONVERTED_PARAMS_DIR, load_model, save_params
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
SUPPORTED = ("LlamaForCausalLM", "Mamba2ForCausalLM", "BambaForCausalLM", "GraniteMoeHybridForCausalLM", "NemotronHForCausalLM",
             "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
             "Qwen3_5MoeForConditionalGeneration", "Lfm2ForCausalLM")


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
    with pytest.raises(ValueError, match=r"Lfm2ForCausalLM: unsupported value layer_types='sliding_attention'; "
                                         r"supported: conv, full_attention"):
        load_model(tmp_path)


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
    [([0.0, {"__float__": "Infinity"}], (0.0, math.inf)), ([0.0, math.inf], (0.0, math.inf)), ([0.01, 5.0], (0.01, 5.0))],
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
