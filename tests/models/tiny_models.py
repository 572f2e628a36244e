"""Tiny, randomly initialised Hugging Face models of every supported architecture.

The models serve as references: a test saves one with `save_tiny_model`, loads the same
directory into jaxengine and compares against the returned torch model (`hf_logits`,
`hf_greedy`). They are tiny (hidden size 64, vocabulary 128, two to five layers) so that
torch is cheap and jaxengine compiles quickly.

Hugging Face's initialisation makes a poor test model, so `perturb_` changes it (seeded):
  * constants hide transposition and indexing bugs: norm weights (1, or 0 where zero-centred),
    `D` (1), conv and projection biases and Nemotron-H's router correction bias (0) get noise;
  * the SSM would barely remember anything: `A_log = log(1..H)` and time steps of
    0.001..0.1 make the state's contribution vanish next to the local `D` skip, so bugs in
    carrying state across chunks, steps or decode would not show. `A_log` and `dt_bias` are
    redrawn so that decays per token are ~0.5-0.9 (Gated DeltaNet's too: its `A_log` of
    log(U(0.01, 16)) would decay most heads' state within a token or two);
  * weights of std 0.02 (`initializer_range`) leave the mixers' output tiny against the
    residual stream; `INIT_STD = 0.1` makes context move the logits by 10-100% of their scale,
    so a greedy continuation depends on the whole prompt, not just on the last token;
  * the final norm weight is scaled by `LOGIT_SCALE` for logits of magnitude ~10, like a
    trained model's.
"""

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    FalconH1Config,
    FalconH1ForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    NemotronHConfig,
    NemotronHForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    Zamba2Config,
    Zamba2ForCausalLM,
)

# Every supported architecture as transformers saves it; "qwen3_5_vl" (a released Qwen3.5
# checkpoint's layout, the text model inside a vision-language one) is built too.
ARCHS = (
    "llama",
    "mamba2",
    "bamba",
    "granite_moe",
    "granite_dense",
    "nemotron_h",
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "lfm2",
    "falcon_h1",
    "falcon_h1_plain",
    "zamba2",
    "jamba",
)
VOCAB_SIZE = 128
CHUNK_SIZE = 8  # Mamba2 chunk size: small, so short prompts span several chunks
MAX_POSITIONS = 512  # room for the engine tests' longer prompts
INIT_STD = 0.1  # std of Hugging Face's normal initialisation of weights and embeddings
NOISE_SCALE = 0.3
A_LOG_MEAN = -1.0  # A = -exp(A_log) ~ -0.37; with dt ~ softplus(N(0, 0.3)) ~ 0.7, decay ~ 0.77
CONV_BIAS_SCALE = 0.1  # a larger bias would drown the token-dependent part of the conv
LOGIT_SCALE = 4.0
# float32 engine vs float32 torch: rounding differences only (~1e-6 on logits of ~10), while a
# real mistake moves logits by O(1). See test_parity.py.
FLOAT32_ATOL = 1e-4
# `LLM` settings the model tests share; equal settings let later tests reuse compiled steps.
# No warm-up (it compiles every step shape; a test needs a few) and no persistent compilation
# cache, so the tests neither depend on nor write to state outside the run.
ENGINE_ARGS = dict(
    max_model_len=128,
    page_size=4,
    max_num_seqs=16,
    max_num_batched_tokens=512,
    warm_up=False,
    compilation_cache_dir=None,
)

_MAMBA = dict(mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2)
_ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2)
# Three Gated DeltaNet layers to one gated attention layer; two value heads per key head;
# partial rotary embedding (a quarter of the head).
_QWEN = dict(
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    max_position_embeddings=MAX_POSITIONS,
)
_QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def tiny_config(arch: str, *, tie: bool = False) -> tuple[type[PreTrainedModel], PretrainedConfig]:
    """The model class and a tiny config for `arch` (one of `ARCHS`)."""
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, tie_word_embeddings=tie, initializer_range=INIT_STD)
    if arch == "llama":
        return LlamaForCausalLM, LlamaConfig(
            **common, **_ATTENTION, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=MAX_POSITIONS
        )
    if arch == "mamba2":
        return Mamba2ForCausalLM, Mamba2Config(
            **common,
            num_hidden_layers=2,
            num_heads=8,
            head_dim=16,
            expand=2,
            state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=CHUNK_SIZE,
        )
    if arch == "bamba":
        return BambaForCausalLM, BambaConfig(
            **common,
            **_ATTENTION,
            **_MAMBA,
            intermediate_size=128,
            num_hidden_layers=3,
            attn_layer_indices=[1],
            mamba_d_head="auto",
            mamba_chunk_size=CHUNK_SIZE,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "granite_moe":  # MoE feed-forward, rope, and every Granite multiplier != 1
        return GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig(
            **common,
            **_ATTENTION,
            **_MAMBA,
            intermediate_size=32,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=96,
            mamba_chunk_size=CHUNK_SIZE,
            position_embedding_type="rope",
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.125,
            logits_scaling=2.0,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "granite_dense":  # dense shared MLP only, attention without positional embedding
        return GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig(
            **common,
            **_ATTENTION,
            **_MAMBA,
            intermediate_size=32,
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            num_local_experts=0,
            shared_intermediate_size=96,
            mamba_chunk_size=CHUNK_SIZE,
            position_embedding_type=None,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "nemotron_h":  # Mamba, attention, squared-ReLU MLP, Mamba, MoE
        return NemotronHForCausalLM, NemotronHConfig(
            **common,
            **_ATTENTION,
            hybrid_override_pattern="M*-ME",
            head_dim=16,
            intermediate_size=128,
            mamba_num_heads=8,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            chunk_size=CHUNK_SIZE,
            expand=2,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "qwen3_next":  # MoE layers and one dense layer (mlp_only_layers), grouped projections
        return Qwen3NextForCausalLM, Qwen3NextConfig(
            **common,
            **_QWEN,
            **_QWEN_MOE,
            intermediate_size=96,
            mlp_only_layers=[2],
            norm_topk_prob=True,
        )
    if arch == "qwen3_5":  # dense, flat projections
        return Qwen3_5ForCausalLM, Qwen3_5TextConfig(**common, **_QWEN, intermediate_size=96)
    if arch == "qwen3_5_moe":
        return Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**common, **_QWEN, **_QWEN_MOE)
    if arch == "lfm2":  # short convs around an attention layer, biases on, the MLP width auto-adjusted (to 96)
        return Lfm2ForCausalLM, Lfm2Config(
            **common,
            **_ATTENTION,
            intermediate_size=128,
            num_hidden_layers=3,
            layer_types=["conv", "full_attention", "conv"],
            conv_L_cache=3,
            conv_bias=True,
            block_multiple_of=16,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "falcon_h1":  # every muP multiplier != 1, mamba_d_ssm != expand * hidden, norm then gate, biases on
        return FalconH1ForCausalLM, FalconH1Config(
            **common,
            **_ATTENTION,
            head_dim=16,
            intermediate_size=96,
            num_hidden_layers=2,
            mamba_d_ssm=96,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=CHUNK_SIZE,
            mamba_rms_norm=True,
            mamba_norm_before_gate=True,
            mamba_proj_bias=True,
            projectors_bias=True,
            attention_bias=True,
            mlp_bias=True,
            embedding_multiplier=2.0,
            lm_head_multiplier=0.5,
            key_multiplier=0.7,
            attention_in_multiplier=1.1,
            attention_out_multiplier=0.9,
            ssm_in_multiplier=1.3,
            ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9],
            ssm_out_multiplier=0.6,
            mlp_multipliers=[0.8, 1.25],
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "falcon_h1_plain":  # the defaults: no Mamba2 norm (only the gate), multipliers 1, no biases
        return FalconH1ForCausalLM, FalconH1Config(
            **common,
            **_ATTENTION,
            head_dim=16,
            intermediate_size=96,
            num_hidden_layers=2,
            mamba_d_ssm=None,
            mamba_n_heads=8,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=CHUNK_SIZE,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "zamba2":  # three uses of two shared blocks (block 0 twice), adapters on q/k/v too, RoPE, biases
        return Zamba2ForCausalLM, Zamba2Config(
            **{**common, "tie_word_embeddings": True},
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=96,
            num_hidden_layers=5,
            layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"],
            n_mamba_heads=8,
            mamba_ngroups=2,
            mamba_d_state=16,
            mamba_d_conv=4,
            chunk_size=CHUNK_SIZE,
            num_mem_blocks=2,
            use_shared_attention_adapter=True,
            adapter_rank=8,
            use_mem_rope=True,
            add_bias_linear=True,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "jamba":  # Mamba-1, MoE, attention, dense MLP; projection biases on
        return JambaForCausalLM, JambaConfig(
            **common,
            **_ATTENTION,
            intermediate_size=96,
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=0,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank="auto",
            mamba_proj_bias=True,
            max_position_embeddings=MAX_POSITIONS,
        )
    if arch == "qwen3_5_vl":  # a released checkpoint's layout: the text model inside a vision-language one
        vision = dict(
            depth=1,
            hidden_size=32,
            num_heads=2,
            intermediate_size=64,
            out_hidden_size=64,
            patch_size=4,
            temporal_patch_size=1,
            spatial_merge_size=1,
        )
        text = dict(**common, **_QWEN, intermediate_size=96)
        return Qwen3_5ForConditionalGeneration, Qwen3_5Config(
            text_config=text, vision_config=vision, tie_word_embeddings=tie
        )
    raise ValueError(f"unknown arch {arch!r}; known: {', '.join(ARCHS)}")


def _perturbed(name: str, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor | None:
    """The new value of tensor `name` (given standard normal `noise` of its shape), or None
    to keep Hugging Face's initialisation."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return A_LOG_MEAN + NOISE_SCALE * noise
    if leaf == "dt_bias":
        return NOISE_SCALE * noise
    if name.endswith(("conv1d.bias", "conv.conv.bias", "_proj.bias")):
        return CONV_BIAS_SCALE * noise
    if leaf in ("D", "e_score_correction_bias") or "norm" in name or name.endswith(("gate.weight", "router.weight")):
        return t + NOISE_SCALE * noise
    return None


def _is_final_norm(name: str) -> bool:
    return "norm" in name and ".layers." not in name


@torch.no_grad()
def perturb_(model: PreTrainedModel, seed: int) -> None:
    """Re-draws the constant-initialised tensors (seeded) and scales the final norm weight."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())  # shared (tied) parameters appear once
    tensors.update(model.named_buffers())
    for name, t in tensors.items():
        new = _perturbed(name, t, torch.randn(t.shape, generator=gen, dtype=t.dtype))
        if new is not None:
            t.copy_(new)
        if _is_final_norm(name):
            t.mul_(LOGIT_SCALE)


def build_tiny_model(arch: str, *, seed: int = 0, tie: bool = False) -> PreTrainedModel:
    """A perturbed tiny torch model of `arch`, in eval mode."""
    cls, cfg = tiny_config(arch, tie=tie)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    perturb_(model, seed)
    return model


def save_tiny_model(arch: str, path: str | Path, *, seed: int = 0, tie: bool = False) -> PreTrainedModel:
    """Builds the tiny `arch` model (see `build_tiny_model`), saves it to `path` with
    `save_pretrained` (config.json + model.safetensors, no tokenizer) and returns it."""
    model = build_tiny_model(arch, seed=seed, tie=tie)
    model.save_pretrained(path)
    return model


def random_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids drawn uniformly from the tiny vocabulary."""
    return np.random.default_rng(seed).integers(0, VOCAB_SIZE, size=length).tolist()


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """Runs torch single-threaded: on these tiny tensors, intra-op threads cost far more than
    they save (10x and more on a busy two-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@torch.no_grad()
@_one_torch_thread()
def hf_logits(model: PreTrainedModel, token_ids: list[int]) -> np.ndarray:
    """The reference model's float32 logits `[len, vocab]` for one prompt (a full forward)."""
    return model(torch.tensor([token_ids])).logits[0].float().numpy()


@torch.no_grad()
@_one_torch_thread()
def hf_greedy(model: PreTrainedModel, token_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference model's greedy continuation of one prompt, ignoring end-of-sequence: a
    full forward without a cache per token, so that no cache code of the reference is
    trusted (Jamba's drops the state when a multi-token chunk continues from a cache)."""
    ids = list(token_ids)
    for _ in range(max_new_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(token_ids) :]


def max_abs_diff(got: np.ndarray, want: np.ndarray) -> float:
    """Largest absolute difference of two equally shaped arrays (computed in float64)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)).max())
