"""A new architecture from its family definition alone: config mapping and tensor rules.

"TinyHybridForCausalLM" is made up: its config.json has its own field names (a config class
transformers does not know reads it) and its checkpoint its own tensor names, with the MLP's
gate and up projections fused into one tensor. Its family, defined here and registered with
`arch.register`, maps it onto the existing attention and Mamba2 mixers. The reference is a
tiny transformers Bamba model: its weights, renamed, are the new checkpoint, so the new
architecture must load into the same config and parameters as the Bamba checkpoint does and
give transformers' logits.
"""

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from transformers import PretrainedConfig, PreTrainedModel

from jaxengine import LLM
from jaxengine.models.arch import ARCHITECTURES, load_model_config, register
from jaxengine.models.arch.family import Family
from jaxengine.models.arch.rules import Rule, layer, layer_paths, top
from jaxengine.models.config import AttentionConfig, LayerSpec, MambaConfig, MlpConfig, ModelConfig
from jaxengine.models.loader import load_model
from tests.models.test_loader import assert_same_params, flat_params
from tests.models.tiny_models import (
    ENGINE_ARGS,
    FLOAT32_ATOL,
    hf_logits,
    max_abs_diff,
    random_prompt,
    save_tiny_model,
)

ARCH = "TinyHybridForCausalLM"
PROMPT = random_prompt(29, seed=1)

# ---------------------------------------------------------------------------- the new family


class TinyHybridConfig(PretrainedConfig):
    model_type = "tiny_hybrid"


BLOCK_MIXERS = {"ssm": "mamba", "attn": "attention"}  # config.json's block kinds -> mixer types


def tiny_hybrid_config(hf: PretrainedConfig, block_mixers: dict[str, str] = BLOCK_MIXERS) -> ModelConfig:
    head_dim = hf.width // hf.attn_heads
    return ModelConfig(
        architecture=hf.architectures[0],
        vocab_size=hf.vocab,
        hidden_size=hf.width,
        layers=tuple(LayerSpec(block_mixers[kind], "mlp") for kind in hf.blocks),
        rms_norm_eps=hf.eps,
        tie_word_embeddings=False,
        attention=AttentionConfig(
            num_heads=hf.attn_heads,
            num_kv_heads=hf.attn_kv_heads,
            head_dim=head_dim,
            rotary_dim=hf.rope_dims,
            rope_theta=hf.rope_base,
            sm_scale=head_dim**-0.5,
            bias=False,
        ),
        mamba=MambaConfig(
            num_heads=hf.ssm_heads,
            head_dim=hf.ssm_head_width,
            state_size=hf.ssm_state,
            n_groups=hf.ssm_groups,
            conv_kernel=hf.ssm_kernel,
            chunk_size=hf.ssm_chunk,
            time_step_limit=(0.0, math.inf),
            conv_bias=True,
            proj_bias=False,
            out_proj_bias=False,
        ),
        mlp=MlpConfig(hf.ffn_width, "silu", gated=True, bias=False),
        moe=None,
        max_position_embeddings=hf.context,
        eos_token_ids=(hf.stop_id,),
    )


B = r"blocks\.(?P<layer>\d+)\."
RULES = [
    Rule(r"^tok_emb\.weight$", top("embed")),
    Rule(r"^out_norm\.scale$", top("final_norm", "weight")),
    Rule(r"^head\.weight$", top("lm_head", "kernel"), "linear"),
    Rule(B + r"pre_mix\.scale$", layer("mixer_norm/weight")),
    Rule(B + r"pre_ffn\.scale$", layer("ffn_norm/weight")),
    Rule(B + r"attn\.w(?P<p>[qkvo])\.weight$", layer("attention/{p}_proj/kernel"), "linear"),
    Rule(B + r"ssm\.(?P<sub>in_proj|out_proj)\.weight$", layer("mamba/{sub}/kernel"), "linear"),
    Rule(B + r"ssm\.conv\.weight$", layer("mamba/conv_weight"), "conv"),
    Rule(B + r"ssm\.conv\.bias$", layer("mamba/conv_bias")),
    Rule(B + r"ssm\.(?P<p>dt_bias|A_log|D)$", layer("mamba/{p}")),
    Rule(B + r"ssm\.norm\.scale$", layer("mamba/norm/weight")),
    Rule(B + r"ffn\.w_in\.weight$", layer_paths("mlp/gate_proj/kernel", "mlp/up_proj/kernel"), "split"),
    Rule(B + r"ffn\.w_out\.weight$", layer("mlp/down_proj/kernel"), "linear"),
]

TINY_HYBRID = Family(tiny_hybrid_config, RULES, config_class=TinyHybridConfig)

# ---------------------------------------------------------------------------- its checkpoint

# The tiny Bamba model's config (`tiny_models.py`) in the new architecture's words.
CONFIG = dict(
    model_type="tiny_hybrid",
    vocab=128,
    width=64,
    blocks=["ssm", "attn", "ssm"],
    eps=1e-5,
    context=512,
    stop_id=2,
    attn_heads=4,
    attn_kv_heads=2,
    rope_dims=8,
    rope_base=10000.0,
    ssm_heads=8,
    ssm_head_width=16,
    ssm_state=16,
    ssm_groups=2,
    ssm_kernel=4,
    ssm_chunk=8,
    ffn_width=128,
)

# Bamba's tensor names -> the new architecture's.
RENAMES = [
    (r"^model\.embed_tokens\.weight$", "tok_emb.weight"),
    (r"^model\.final_layernorm\.weight$", "out_norm.scale"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.layers\.(\d+)\.input_layernorm\.weight$", r"blocks.\1.pre_mix.scale"),
    (r"^model\.layers\.(\d+)\.pre_ff_layernorm\.weight$", r"blocks.\1.pre_ffn.scale"),
    (r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight$", r"blocks.\1.attn.w\2.weight"),
    (r"^model\.layers\.(\d+)\.mamba\.(in_proj|out_proj)\.weight$", r"blocks.\1.ssm.\2.weight"),
    (r"^model\.layers\.(\d+)\.mamba\.conv1d\.(weight|bias)$", r"blocks.\1.ssm.conv.\2"),
    (r"^model\.layers\.(\d+)\.mamba\.(dt_bias|A_log|D)$", r"blocks.\1.ssm.\2"),
    (r"^model\.layers\.(\d+)\.mamba\.norm\.weight$", r"blocks.\1.ssm.norm.scale"),
    (r"^model\.layers\.(\d+)\.feed_forward\.down_proj\.weight$", r"blocks.\1.ffn.w_out.weight"),
]


def write_tiny_hybrid(bamba_dir: Path, out: Path, architecture: str = ARCH) -> None:
    """The Bamba checkpoint's weights under the new names, gate and up fused (`[2 * n, in]`),
    and a config.json written by hand."""
    tensors: dict[str, np.ndarray] = {}
    bamba = load_file(bamba_dir / "model.safetensors")
    for name, value in bamba.items():
        if m := re.fullmatch(r"model\.layers\.(\d+)\.feed_forward\.(gate|up)_proj\.weight", name):
            if m.group(2) == "gate":
                up = bamba[name.replace("gate_proj", "up_proj")]
                tensors[f"blocks.{m.group(1)}.ffn.w_in.weight"] = np.concatenate([value, up])
            continue
        renamed = [re.sub(pattern, new, name) for pattern, new in RENAMES if re.search(pattern, name)]
        assert len(renamed) == 1, name  # every Bamba tensor has exactly one new name
        tensors[renamed[0]] = value
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({"architectures": [architecture], **CONFIG}))


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def bamba(tmp_path_factory) -> tuple[Path, PreTrainedModel]:
    """The reference: a saved tiny Bamba checkpoint and its torch model."""
    path = tmp_path_factory.mktemp("bamba")
    return path, save_tiny_model("bamba", path)


@pytest.fixture
def registered():
    """`register(architecture, family)` for one test; the registry is as before after it."""
    added = []

    def add(architecture: str, family: Family) -> None:
        register(architecture, family)
        added.append(architecture)

    yield add
    for architecture in added:
        del ARCHITECTURES[architecture]


@pytest.fixture
def tiny_hybrid(bamba, registered, tmp_path) -> Path:
    """The new architecture registered, and its checkpoint."""
    registered(ARCH, TINY_HYBRID)
    write_tiny_hybrid(bamba[0], tmp_path / "tiny_hybrid")
    return tmp_path / "tiny_hybrid"


# ---------------------------------------------------------------------------- tests


def test_the_new_architecture_loads_as_its_reference_and_gives_its_logits(bamba, tiny_hybrid):
    bamba_dir, bamba_model = bamba
    cfg, _, state = load_model(tiny_hybrid)
    assert cfg == dataclasses.replace(load_model_config(bamba_dir), architecture=ARCH)
    assert_same_params(state, load_model(bamba_dir)[2])
    logits = LLM(tiny_hybrid, dtype="float32", **ENGINE_ARGS).prompt_logits(PROMPT)
    assert max_abs_diff(logits, hf_logits(bamba_model, PROMPT)) <= FLOAT32_ATOL


def test_a_wrong_mapping_changes_the_parameters_and_the_logits(bamba, registered, tmp_path):
    """The mixer and feed-forward norms swapped: every tensor has a parameter of its shape,
    so only the comparison with the reference shows the mistake, in the parameters and in
    the logits."""
    rules = [
        Rule(B + r"pre_mix\.scale$", layer("ffn_norm/weight")),
        Rule(B + r"pre_ffn\.scale$", layer("mixer_norm/weight")),
        *(rule for rule in RULES if "pre_" not in rule.pattern),
    ]
    registered(ARCH, Family(tiny_hybrid_config, rules, config_class=TinyHybridConfig))
    path = tmp_path / "tiny_hybrid"
    write_tiny_hybrid(bamba[0], path)
    got, want = flat_params(load_model(path)[2]), flat_params(load_model(bamba[0])[2])
    differ = {name for name, value in got.items() if not np.array_equal(value, want[name])}
    assert differ == {f"layers/{i}/{norm}/weight" for i in range(3) for norm in ("mixer_norm", "ffn_norm")}
    logits = LLM(path, dtype="float32", **ENGINE_ARGS).prompt_logits(PROMPT)
    assert max_abs_diff(logits, hf_logits(bamba[1], PROMPT)) > 100 * FLOAT32_ATOL


def test_a_tensor_no_rule_reads_is_named(bamba, registered, tmp_path):
    rules = [rule for rule in RULES if "w_out" not in rule.pattern]
    registered(ARCH, Family(tiny_hybrid_config, rules, config_class=TinyHybridConfig))
    write_tiny_hybrid(bamba[0], tmp_path / "tiny_hybrid")
    with pytest.raises(ValueError, match=r"unexpected tensor 'blocks\.0\.ffn\.w_out\.weight'"):
        load_model(tmp_path / "tiny_hybrid")


def test_a_parameter_no_tensor_fills_is_named(tiny_hybrid):
    tensors = load_file(tiny_hybrid / "model.safetensors")
    del tensors["blocks.2.ssm.D"]
    save_file(tensors, tiny_hybrid / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors for parameters layers/2/mamba/D"):
        load_model(tiny_hybrid)


def test_a_mixer_the_model_code_lacks_is_named(bamba, registered, tmp_path):
    def unknown_mixer(hf: PretrainedConfig) -> ModelConfig:
        return tiny_hybrid_config(hf, {**BLOCK_MIXERS, "ssm": "mamba3"})

    registered("TinyHybridV2ForCausalLM", Family(unknown_mixer, RULES, config_class=TinyHybridConfig))
    write_tiny_hybrid(bamba[0], tmp_path / "tiny_hybrid", "TinyHybridV2ForCausalLM")
    with pytest.raises(
        ValueError, match=r"TinyHybridV2ForCausalLM: layer 0 has mixer 'mamba3'.*known: attention, mamba"
    ):
        load_model_config(tmp_path / "tiny_hybrid")


def test_an_architecture_is_registered_once(registered):
    registered(ARCH, TINY_HYBRID)
    with pytest.raises(ValueError, match=f"architecture '{ARCH}' is already registered"):
        register(ARCH, TINY_HYBRID)
