"""Gated DeltaNet checkpoints (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) in the layouts they come in:
a released vision-language directory, fused or per-expert MoE tensors, and the errors that
name what is wrong."""

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxengine.models.arch import load_model_config
from jaxengine.models.loader import load_model
from tests.models.test_loader import assert_same_params, edit_config, edit_tensors, engine_logits
from tests.models.tiny_models import FLOAT32_ATOL, hf_logits, max_abs_diff, random_prompt, save_tiny_model

PROMPT = random_prompt(29, seed=1)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_5")
    save_tiny_model("qwen3_5", path)
    return path


def test_a_released_vision_language_directory_serves_its_text_model(tmp_path, caplog):
    """`Qwen3_5ForConditionalGeneration`: the text model from `text_config` and
    `model.language_model.*`, the vision tower and the MTP head left alone and said so."""
    model = save_tiny_model("qwen3_5_vl", tmp_path)
    edit_tensors(tmp_path, lambda t: t.update({"mtp.fc.weight": np.zeros((64, 128), np.float32)}))
    assert load_model_config(tmp_path).architecture == "Qwen3_5ForCausalLM"
    with caplog.at_level(logging.INFO, logger="jaxengine"):
        got = engine_logits(tmp_path)
    assert max_abs_diff(got, hf_logits(model, PROMPT)) <= FLOAT32_ATOL
    skipped = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
    assert len(skipped) == 2 and any("model.visual." in m for m in skipped) and any("mtp." in m for m in skipped)


def _fuse_experts(tensors: dict[str, np.ndarray]) -> None:
    """Per-expert gate/up/down tensors -> transformers' fused `gate_up_proj` [E, 2I, D] and
    `down_proj` [E, D, I], as released Qwen3.5-MoE checkpoints store them."""
    layers = sorted({name.split(".mlp.experts.")[0] for name in tensors if ".mlp.experts." in name})
    for layer in layers:
        prefix = f"{layer}.mlp.experts."
        num = 1 + max(int(n[len(prefix) :].split(".")[0]) for n in tensors if n.startswith(prefix))
        parts = [tuple(tensors.pop(f"{prefix}{e}.{p}_proj.weight") for p in ("gate", "up", "down")) for e in range(num)]
        tensors[prefix + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u, _ in parts])
        tensors[prefix + "down_proj"] = np.stack([d for _, _, d in parts])


def test_fused_expert_tensors_load_like_per_expert_ones(tmp_path):
    per_expert, fused = tmp_path / "per_expert", tmp_path / "fused"
    save_tiny_model("qwen3_5_moe", per_expert)
    shutil.copytree(per_expert, fused)
    edit_tensors(fused, _fuse_experts)
    assert_same_params(load_model(fused)[2], load_model(per_expert)[2])


def test_a_missing_projection_names_the_columns_it_leaves_empty(qwen3_5, tmp_path):
    broken = Path(shutil.copytree(qwen3_5, tmp_path / "model"))
    edit_tensors(broken, lambda t: t.pop("model.layers.0.linear_attn.in_proj_z.weight"))
    with pytest.raises(
        ValueError, match=r"missing columns \[96, 128\) of parameter layers/0/gated_delta/in_proj/kernel"
    ):
        load_model(broken)


@pytest.mark.parametrize(
    "edit, message",
    [
        pytest.param(
            lambda c: c.update(linear_num_value_heads=3),
            r"linear_num_value_heads=3; supported: a multiple",
            id="value-heads",
        ),
        pytest.param(
            lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding_attention"]),
            r"layer_types='sliding_attention'; supported: linear_attention, full_attention",
            id="layer-type",
        ),
        pytest.param(lambda c: c.update(hidden_act="gelu"), r"hidden_act='gelu'; supported: silu", id="activation"),
    ],
)
def test_unsupported_config_values_are_named(qwen3_5, tmp_path, edit, message):
    broken = Path(shutil.copytree(qwen3_5, tmp_path / "model"))
    edit_config(broken, edit)
    with pytest.raises(ValueError, match=f"Qwen3_5ForCausalLM: unsupported value {message}"):
        load_model_config(broken)
