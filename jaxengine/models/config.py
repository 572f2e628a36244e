"""Model configuration: one frozen dataclass that every supported architecture maps onto.

A model is a stack of layers, each with an optional *mixer* (attention, Mamba2, Mamba-1,
Gated DeltaNet or a short convolution; Falcon-H1 runs two side by side) and an optional
*feed-forward* (gated MLP, squared-ReLU MLP, or mixture of experts), both pre-norm residual
branches. The per-architecture functions below read a Hugging Face config and fill
this table; the model code only ever sees `ModelConfig`.
"""

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from transformers import AutoConfig, PretrainedConfig

Mixer = Literal[
    "attention", "mamba", "mamba1", "gated_delta", "short_conv"
]  # the types of `jaxengine/models/mixers.py`
FeedForward = Literal["mlp", "moe"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer holds; `None` means the branch is absent. `parallel` is a second
    mixer on the same normed input, its output added to the first's (Falcon-H1's attention
    beside its Mamba2)."""

    mixer: Mixer | None
    ffn: FeedForward | None
    parallel: Mixer | None = None
    shared_block: int | None = None  # Zamba2: the shared transformer block run first (`shared_block.py`)

    @property
    def mixers(self) -> tuple[Mixer, ...]:
        """The layer's mixers, in the order their caches are laid out."""
        return tuple(m for m in (self.mixer, self.parallel) if m is not None)

    @property
    def num_kv_uses(self) -> int:
        """The sets of KV pages the layer writes: one per attention mixer and one for its use
        of a shared block."""
        return self.mixers.count("attention") + (self.shared_block is not None)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with optional (partial) rotary embeddings.

    `output_gate`: `q_proj` emits each head's query and a gate, and the attention output is
    multiplied by sigmoid(gate) (Qwen3-Next, Qwen3.5). `qk_norm`: an RMS norm over each
    head's query and key before the rotary embedding, scaling by `qk_norm_offset + w`."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # 0: no positional embedding
    rope_theta: float
    sm_scale: float
    bias: bool
    output_gate: bool = False
    qk_norm: bool = False
    qk_norm_offset: float = 0.0


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """A Mamba2 (SSD) mixer. `gated_norm` is the output's gate and RMS norm (over `n_groups`
    groups): "gate_first" norms `y * silu(z)` (Mamba2, Bamba), "norm_first" gates the normed
    `y`, "none" only gates (Falcon-H1 without `mamba_rms_norm`). `proj_bias` is the input
    projection's bias, `out_proj_bias` the output's."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    time_step_limit: tuple[float, float]
    conv_bias: bool
    proj_bias: bool
    out_proj_bias: bool
    gated_norm: Literal["gate_first", "norm_first", "none"] = "gate_first"
    norm_eps: float | None = None  # the gated norm's epsilon; None: the model's rms_norm_eps

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size


@dataclasses.dataclass(frozen=True)
class Mamba1Config:
    """A Mamba-1 (selective scan) mixer: per-channel states of `state_size` over
    `intermediate_size` channels, a `dt_rank` step-size projection, and with `bcdt_norms`
    RMS norms on dt, B and C (Jamba). `chunk_size` is the scan's, not the model's: any value
    gives the same outputs."""

    intermediate_size: int
    state_size: int
    conv_kernel: int
    dt_rank: int
    conv_bias: bool
    proj_bias: bool
    bcdt_norms: bool
    chunk_size: int = 64


@dataclasses.dataclass(frozen=True)
class GatedDeltaConfig:
    """A Gated DeltaNet mixer (Qwen3-Next, Qwen3.5): value heads grouped over key heads.

    The input projection is one matrix, output columns q | k | v | z | b | a (the loader
    assembles it from either checkpoint layout). `chunk_size` is the scan's, not the model's:
    any value gives the same outputs."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    chunk_size: int = 64

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q | k | v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def projection_size(self) -> int:
        return self.conv_dim + self.value_dim + 2 * self.num_value_heads


@dataclasses.dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's short-convolution mixer: a depthwise causal conv of `conv_kernel` taps over
    `channels` (the hidden size), gated before and after; `bias` on its projections and conv."""

    channels: int
    conv_kernel: int
    bias: bool


@dataclasses.dataclass(frozen=True)
class MlpConfig:
    """A dense feed-forward: gated (`act(gate) * up`) or plain (`act(up)`)."""

    intermediate_size: int
    activation: Literal["silu", "relu2", "gelu"]
    gated: bool
    bias: bool


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """Routed experts plus an always-on shared expert.

    `router="softmax_topk"`: Granite's top-k of the router logits, softmaxed over the k.
    `router="softmax"`: Qwen's softmax over all experts, top-k of it, renormalised over the k
    when `norm_topk_prob`.
    `router="sigmoid_grouped"`: Nemotron-H's sigmoid scores, bias-corrected group-limited
    selection, optionally renormalised, times `routed_scaling_factor`.
    `shared_gate`: the shared expert's output is multiplied by sigmoid(x . w) (Qwen).
    `shared=None`: no shared expert (Jamba).
    """

    num_experts: int
    top_k: int
    expert: MlpConfig
    shared: MlpConfig | None
    router: Literal["softmax_topk", "softmax", "sigmoid_grouped"]
    shared_gate: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class SharedBlockConfig:
    """Zamba2's shared transformer blocks: `num_blocks` of them, used in turn by the layers
    whose `LayerSpec.shared_block` names one. A block is attention (`ModelConfig.attention`)
    over the RMS-normed concat(hidden, input embeddings) of width 2 * hidden, then the gated
    MLP (`ModelConfig.mlp`) over the normed attention output. Each use adds its own low-rank
    adapters (rank `adapter_rank`) to the MLP's gate | up and, with `attention_adapters`, to
    q, k and v, and projects the block's output with its own linear."""

    num_blocks: int
    adapter_rank: int
    attention_adapters: bool


@dataclasses.dataclass(frozen=True)
class MupMultipliers:
    """Falcon-H1's muP multipliers on its projections' inputs and outputs. The loader folds
    them into the projection weights and biases (`loader.py`); the model code never sees
    them. `ssm` scales the Mamba2 input projection's columns z | x | B | C | dt."""

    attention_in: float
    key: float
    attention_out: float
    ssm_in: float
    ssm: tuple[float, float, float, float, float]
    ssm_out: float
    mlp_gate: float
    mlp_down: float


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs, whatever the source architecture."""

    architecture: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention: AttentionConfig | None
    mamba: MambaConfig | None
    mlp: MlpConfig | None
    moe: MoeConfig | None
    gated_delta: GatedDeltaConfig | None = None
    short_conv: ShortConvConfig | None = None
    mamba1: Mamba1Config | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    norm_weight_in_fp32: bool = False  # Nemotron-H scales by the norm weight before casting back
    norm_weight_offset: float = 0.0  # 1.0: zero-centred norm weights, scale by 1 + w (Qwen3-Next, Qwen3.5)
    max_position_embeddings: int = 4096
    eos_token_ids: tuple[int, ...] = ()
    mup: MupMultipliers | None = None  # folded into the weights at load
    shared_block: SharedBlockConfig | None = None
    # The multi-token-prediction module's decoder layers (`mtp.py`: the first with full
    # attention, any others feed-forward only), when the checkpoint has one and speculative
    # decoding uses it; () otherwise.
    mtp_layers: tuple[LayerSpec, ...] = ()

    @property
    def num_attention_layers(self) -> int:
        """The sets of KV pages of the layers (`LayerSpec.num_kv_uses`)."""
        return sum(spec.num_kv_uses for spec in self.layers)

    @property
    def num_kv_layers(self) -> int:
        """Sets of KV pages in the cache blocks: the layers', then the MTP module's."""
        return self.num_attention_layers + sum(spec.num_kv_uses for spec in self.mtp_layers)

    @property
    def num_recurrent_layers(self) -> int:
        """Layers whose mixer keeps a per-sequence state (every mixer but attention)."""
        return sum(m != "attention" for spec in self.layers for m in spec.mixers)


def _fail(architecture: str, field: str, value: Any, supported: str) -> None:
    raise ValueError(f"{architecture}: unsupported value {field}={value!r}; supported: {supported}")


def _rope(hf: PretrainedConfig, head_dim: int, architecture: str) -> tuple[int, float]:
    """(rotary_dim, theta) from `rope_parameters` (or the older top-level `rope_theta`)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        _fail(architecture, "rope_parameters.rope_type", rope_type, "'default'")
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    return int(head_dim * factor), theta


def _attention(
    hf: PretrainedConfig, architecture: str, *, use_rope: bool, head_dim: int | None = None
) -> AttentionConfig:
    head_dim = head_dim or getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rotary_dim, theta = _rope(hf, head_dim, architecture) if use_rope else (0, 10000.0)
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if hf.num_attention_heads % num_kv_heads:
        _fail(
            architecture,
            "num_key_value_heads",
            num_kv_heads,
            f"a divisor of num_attention_heads={hf.num_attention_heads}",
        )
    return AttentionConfig(
        num_heads=hf.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        sm_scale=head_dim**-0.5,
        bias=bool(getattr(hf, "attention_bias", False)),
    )


def _activation(hf: PretrainedConfig, field: str, architecture: str, supported: tuple[str, ...]) -> str:
    act = getattr(hf, field)
    if act not in supported:
        _fail(architecture, field, act, ", ".join(supported))
    return act


def _time_step_limit(value: Any) -> tuple[float, float]:
    low, high = (float(v) if not isinstance(v, dict) else float(v["__float__"]) for v in value)
    return low, high


def _bamba_like_mamba(hf: PretrainedConfig, architecture: str) -> MambaConfig:
    _activation(hf, "hidden_act", architecture, ("silu",))
    num_heads = hf.mamba_n_heads
    head_dim = hf.mamba_d_head
    if head_dim == "auto" or head_dim is None:
        head_dim = hf.mamba_expand * hf.hidden_size // num_heads
    if num_heads % hf.mamba_n_groups:
        _fail(architecture, "mamba_n_groups", hf.mamba_n_groups, f"a divisor of mamba_n_heads={num_heads}")
    return MambaConfig(
        num_heads=num_heads,
        head_dim=int(head_dim),
        state_size=hf.mamba_d_state,
        n_groups=hf.mamba_n_groups,
        conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.mamba_chunk_size,
        time_step_limit=_time_step_limit(hf.time_step_limit or (0.0, math.inf)),
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        out_proj_bias=bool(hf.mamba_proj_bias),
    )


def _eos(hf: PretrainedConfig) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _common(hf: PretrainedConfig, architecture: str) -> dict[str, Any]:
    return dict(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
        eos_token_ids=_eos(hf),
    )


def _llama(hf: PretrainedConfig) -> ModelConfig:
    arch = "LlamaForCausalLM"
    act = _activation(hf, "hidden_act", arch, ("silu",))
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec("attention", "mlp") for _ in range(hf.num_hidden_layers)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=_attention(hf, arch, use_rope=True),
        mamba=None,
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=None,
    )


def _mamba2(hf: PretrainedConfig) -> ModelConfig:
    arch = "Mamba2ForCausalLM"
    _activation(hf, "hidden_act", arch, ("silu",))
    if hf.num_heads * hf.head_dim != hf.expand * hf.hidden_size:
        _fail(
            arch,
            "num_heads * head_dim",
            hf.num_heads * hf.head_dim,
            f"expand * hidden_size = {hf.expand * hf.hidden_size}",
        )
    mamba = MambaConfig(
        num_heads=hf.num_heads,
        head_dim=hf.head_dim,
        state_size=hf.state_size,
        n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        time_step_limit=_time_step_limit(hf.time_step_limit or (0.0, math.inf)),
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        out_proj_bias=bool(hf.use_bias),
    )
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec("mamba", None) for _ in range(hf.num_hidden_layers)),
        rms_norm_eps=hf.layer_norm_epsilon,
        attention=None,
        mamba=mamba,
        mlp=None,
        moe=None,
    )


def _layer_mixers(types: list[str], architecture: str, field: str) -> list[Mixer]:
    table = {"full_attention": "attention", "linear_attention": "mamba"}
    for t in types:
        if t not in table:
            _fail(architecture, field, t, ", ".join(table))
    return [table[t] for t in types]


def _bamba(hf: PretrainedConfig) -> ModelConfig:
    arch = "BambaForCausalLM"
    act = _activation(hf, "hidden_act", arch, ("silu",))
    mixers = _layer_mixers(list(hf.layers_block_type), arch, "attn_layer_indices")
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec(m, "mlp") for m in mixers),
        rms_norm_eps=hf.rms_norm_eps,
        attention=_attention(hf, arch, use_rope=True),
        mamba=_bamba_like_mamba(hf, arch),
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=None,
    )


def _granite_moe_hybrid(hf: PretrainedConfig) -> ModelConfig:
    arch = "GraniteMoeHybridForCausalLM"
    act = _activation(hf, "hidden_act", arch, ("silu",))
    mixers = _layer_mixers(list(hf.layer_types or ["linear_attention"] * hf.num_hidden_layers), arch, "layer_types")
    pos = getattr(hf, "position_embedding_type", None)
    if pos not in (None, "nope", "rope"):
        _fail(arch, "position_embedding_type", pos, "null, 'nope', 'rope'")
    attention = _attention(hf, arch, use_rope=pos == "rope")
    attention = dataclasses.replace(attention, sm_scale=float(hf.attention_multiplier))
    shared = MlpConfig(hf.shared_intermediate_size, act, gated=True, bias=False)
    moe = None
    if hf.num_local_experts > 0:
        expert = MlpConfig(hf.intermediate_size, act, gated=True, bias=False)
        moe = MoeConfig(hf.num_local_experts, hf.num_experts_per_tok, expert, shared, router="softmax_topk")
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec(m, "moe" if moe else "mlp") for m in mixers),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention,
        mamba=_bamba_like_mamba(hf, arch),
        mlp=None if moe else shared,
        moe=moe,
        embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier),
        logits_scaling=float(hf.logits_scaling),
    )


def _nemotron_h(hf: PretrainedConfig) -> ModelConfig:
    arch = "NemotronHForCausalLM"
    table = {
        "linear_attention": LayerSpec("mamba", None),
        "full_attention": LayerSpec("attention", None),
        "mlp": LayerSpec(None, "mlp"),
        "moe": LayerSpec(None, "moe"),
    }
    for t in hf.layers_block_type:
        if t not in table:
            _fail(arch, "layers_block_type", t, ", ".join(table))
    layers = tuple(table[t] for t in hf.layers_block_type)
    mlp_act = _activation(hf, "mlp_hidden_act", arch, ("relu2",))
    _activation(hf, "mamba_hidden_act", arch, ("silu",))
    if getattr(hf, "moe_latent_size", None):
        _fail(arch, "moe_latent_size", hf.moe_latent_size, "null")
    mamba = MambaConfig(
        num_heads=hf.mamba_num_heads,
        head_dim=hf.mamba_head_dim,
        state_size=hf.ssm_state_size,
        n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel,
        chunk_size=hf.chunk_size,
        # The reference implementation ignores `time_step_limit` and clamps at time_step_min.
        time_step_limit=(float(hf.time_step_min), math.inf),
        conv_bias=bool(hf.use_conv_bias),
        proj_bias=bool(hf.use_bias),
        out_proj_bias=bool(hf.use_bias),
    )
    moe = None
    if any(spec.ffn == "moe" for spec in layers):
        moe = MoeConfig(
            num_experts=hf.n_routed_experts,
            top_k=hf.num_experts_per_tok,
            expert=MlpConfig(hf.moe_intermediate_size, mlp_act, gated=False, bias=False),
            shared=MlpConfig(hf.moe_shared_expert_intermediate_size, mlp_act, gated=False, bias=False),
            router="sigmoid_grouped",
            n_group=hf.n_group,
            topk_group=hf.topk_group,
            norm_topk_prob=bool(hf.norm_topk_prob),
            routed_scaling_factor=float(hf.routed_scaling_factor),
        )
    attention = _attention(hf, arch, use_rope=False, head_dim=hf.head_dim)
    return ModelConfig(
        **{**_common(hf, arch), "tie_word_embeddings": False},  # Nemotron-H never ties lm_head
        layers=layers,
        rms_norm_eps=hf.layer_norm_epsilon,
        attention=dataclasses.replace(attention, bias=False),
        mamba=mamba,
        mlp=MlpConfig(hf.intermediate_size, mlp_act, gated=False, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=moe,
        norm_weight_in_fp32=True,
    )


def _qwen_gated_delta(hf: PretrainedConfig, arch: str) -> ModelConfig:
    """Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet and gated attention layers,
    zero-centred norms. Text only: with the same position on its three axes, Qwen3.5's
    multimodal rotary embedding is the plain (partial) one."""
    act = _activation(hf, "hidden_act", arch, ("silu",))
    table = {"linear_attention": "gated_delta", "full_attention": "attention"}
    for t in hf.layer_types:
        if t not in table:
            _fail(arch, "layer_types", t, ", ".join(table))
    if hf.linear_num_value_heads % hf.linear_num_key_heads:
        _fail(
            arch,
            "linear_num_value_heads",
            hf.linear_num_value_heads,
            f"a multiple of linear_num_key_heads={hf.linear_num_key_heads}",
        )
    gated_delta = GatedDeltaConfig(
        num_key_heads=hf.linear_num_key_heads,
        num_value_heads=hf.linear_num_value_heads,
        key_head_dim=hf.linear_key_head_dim,
        value_head_dim=hf.linear_value_head_dim,
        conv_kernel=hf.linear_conv_kernel_dim,
    )
    attention = dataclasses.replace(
        _attention(hf, arch, use_rope=True), output_gate=True, qk_norm=True, qk_norm_offset=1.0
    )
    moe, moe_layers = None, set()
    num_experts = getattr(hf, "num_experts", 0) or 0
    if num_experts:
        moe = MoeConfig(
            num_experts=num_experts,
            top_k=hf.num_experts_per_tok,
            expert=MlpConfig(hf.moe_intermediate_size, act, gated=True, bias=False),
            shared=MlpConfig(hf.shared_expert_intermediate_size, act, gated=True, bias=False),
            router="softmax",
            shared_gate=True,
            norm_topk_prob=bool(getattr(hf, "norm_topk_prob", True)),  # Qwen3.5-MoE always renormalises
        )
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        dense = set(getattr(hf, "mlp_only_layers", None) or [])
        moe_layers = {i for i in range(hf.num_hidden_layers) if i not in dense and (i + 1) % step == 0}
    intermediate = getattr(hf, "intermediate_size", None)
    mlp = MlpConfig(intermediate, act, gated=True, bias=False) if len(moe_layers) < hf.num_hidden_layers else None
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec(table[t], "moe" if i in moe_layers else "mlp") for i, t in enumerate(hf.layer_types)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=attention,
        mamba=None,
        mlp=mlp,
        moe=moe,
        gated_delta=gated_delta,
        norm_weight_offset=1.0,
    )


def _qwen3_next(hf: PretrainedConfig) -> ModelConfig:
    return _qwen_gated_delta(hf, "Qwen3NextForCausalLM")


def _qwen3_5(hf: PretrainedConfig) -> ModelConfig:
    return _qwen_gated_delta(hf, "Qwen3_5ForCausalLM")


def _qwen3_5_moe(hf: PretrainedConfig) -> ModelConfig:
    return _qwen_gated_delta(hf, "Qwen3_5MoeForCausalLM")


def _lfm2_mlp_width(hf: PretrainedConfig) -> int:
    """LFM2's feed-forward width: `intermediate_size`, or with `block_auto_adjust_ff_dim` two
    thirds of it, times `block_ffn_dim_multiplier` and rounded up to `block_multiple_of`."""
    width = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if hf.block_ffn_dim_multiplier is not None:
            width = int(hf.block_ffn_dim_multiplier * width)
            width = hf.block_multiple_of * math.ceil(width / hf.block_multiple_of)
    return width


def _lfm2(hf: PretrainedConfig) -> ModelConfig:
    """LFM2: short-convolution and attention layers (per-head q/k norm), each with a gated
    SiLU MLP; the final norm is the one transformers calls `embedding_norm`."""
    arch = "Lfm2ForCausalLM"
    table = {"conv": "short_conv", "full_attention": "attention"}
    for t in hf.layer_types:
        if t not in table:
            _fail(arch, "layer_types", t, ", ".join(table))
    attention = dataclasses.replace(_attention(hf, arch, use_rope=True), qk_norm=True)
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec(table[t], "mlp") for t in hf.layer_types),
        rms_norm_eps=hf.norm_eps,
        attention=attention if "full_attention" in hf.layer_types else None,
        mamba=None,
        mlp=MlpConfig(_lfm2_mlp_width(hf), "silu", gated=True, bias=False),
        moe=None,
        short_conv=ShortConvConfig(hf.hidden_size, hf.conv_L_cache, bool(hf.conv_bias)),
    )


def _jamba(hf: PretrainedConfig) -> ModelConfig:
    """Jamba: Mamba-1 and attention (no positional embedding) layers by period and offset,
    each with a gated MLP or, by their own period and offset, a MoE of softmax top-k routing
    whose weights are not renormalised, without a shared expert."""
    arch = "JambaForCausalLM"
    act = _activation(hf, "hidden_act", arch, ("silu",))
    for field in ("attn_layer_period", "expert_layer_period"):
        if getattr(hf, field) < 1:
            _fail(arch, field, getattr(hf, field), "a positive period")
    mixers = ["attention" if kind == "attention" else "mamba1" for kind in hf.layers_block_type]
    moe_layers = [n > 1 for n in hf.layers_num_experts]
    rank = hf.mamba_dt_rank
    mamba1 = Mamba1Config(
        intermediate_size=hf.mamba_expand * hf.hidden_size,
        state_size=hf.mamba_d_state,
        conv_kernel=hf.mamba_d_conv,
        dt_rank=math.ceil(hf.hidden_size / 16) if rank == "auto" else int(rank),
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        bcdt_norms=True,
    )
    mlp = MlpConfig(hf.intermediate_size, act, gated=True, bias=False)
    moe = None
    if any(moe_layers):
        moe = MoeConfig(hf.num_experts, hf.num_experts_per_tok, mlp, None, router="softmax", norm_topk_prob=False)
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec(m, "moe" if e else "mlp") for m, e in zip(mixers, moe_layers)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=_attention(hf, arch, use_rope=False) if "attention" in mixers else None,
        mamba=None,
        mlp=mlp if not all(moe_layers) else None,
        moe=moe,
        mamba1=mamba1,
    )


def _falcon_h1(hf: PretrainedConfig) -> ModelConfig:
    """Falcon-H1: every layer runs Mamba2 and attention side by side on the same normed input,
    then a gated MLP; muP multipliers throughout (`MupMultipliers`)."""
    arch = "FalconH1ForCausalLM"
    act = _activation(hf, "hidden_act", arch, ("silu",))
    for field, size in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        if len(getattr(hf, field)) != size:
            _fail(arch, field, getattr(hf, field), f"a list of {size} numbers")
    mamba = _bamba_like_mamba(hf, arch)
    if mamba.intermediate_size != hf.mamba_d_ssm and hf.mamba_d_ssm is not None:
        _fail(arch, "mamba_n_heads * mamba_d_head", mamba.intermediate_size, f"mamba_d_ssm = {hf.mamba_d_ssm}")
    gated_norm = ("norm_first" if hf.mamba_norm_before_gate else "gate_first") if hf.mamba_rms_norm else "none"
    mamba = dataclasses.replace(mamba, out_proj_bias=bool(hf.projectors_bias), gated_norm=gated_norm)
    gate, down = (float(v) for v in hf.mlp_multipliers)
    mup = MupMultipliers(
        attention_in=float(hf.attention_in_multiplier),
        key=float(hf.key_multiplier),
        attention_out=float(hf.attention_out_multiplier),
        ssm_in=float(hf.ssm_in_multiplier),
        ssm=tuple(float(v) for v in hf.ssm_multipliers),
        ssm_out=float(hf.ssm_out_multiplier),
        mlp_gate=gate,
        mlp_down=down,
    )
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(LayerSpec("mamba", "mlp", parallel="attention") for _ in range(hf.num_hidden_layers)),
        rms_norm_eps=hf.rms_norm_eps,
        attention=_attention(hf, arch, use_rope=True),
        mamba=mamba,
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(getattr(hf, "mlp_bias", False))),
        moe=None,
        embedding_multiplier=float(hf.embedding_multiplier),
        logits_scaling=1.0 / float(hf.lm_head_multiplier),
        mup=mup,
    )


def _zamba2(hf: PretrainedConfig) -> ModelConfig:
    """Zamba2: Mamba2 layers, some of which first run a shared transformer block
    (`SharedBlockConfig`) and add its projected output to their input."""
    arch = "Zamba2ForCausalLM"
    act = _activation(hf, "hidden_act", arch, ("gelu", "silu"))
    table = {"mamba": "mamba", "linear_attention": "mamba", "hybrid": "hybrid"}
    for t in hf.layers_block_type:
        if t not in table:
            _fail(arch, "layers_block_type", t, ", ".join(table))
    if hf.use_shared_attention_adapter and hf.num_key_value_heads != hf.num_attention_heads:
        _fail(
            arch,
            "num_key_value_heads",
            hf.num_key_value_heads,
            f"num_attention_heads={hf.num_attention_heads} (the attention adapters are as wide as the queries)",
        )
    layers, uses = [], 0
    for t in hf.layers_block_type:
        block = None
        if table[t] == "hybrid":
            block, uses = uses % hf.num_mem_blocks, uses + 1
        layers.append(LayerSpec("mamba", None, shared_block=block))
    head_dim = hf.attention_head_dim
    attention = _attention(hf, arch, use_rope=bool(hf.use_mem_rope), head_dim=head_dim)
    mamba = MambaConfig(
        num_heads=hf.n_mamba_heads,
        head_dim=hf.mamba_headdim,
        state_size=hf.mamba_d_state,
        n_groups=hf.mamba_ngroups,
        conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.chunk_size,
        # As Nemotron-H's: the reference's chunked scan clamps at time_step_min.
        time_step_limit=(float(hf.time_step_min), math.inf),
        conv_bias=True,  # the reference always builds the conv with a bias
        proj_bias=bool(hf.add_bias_linear),
        out_proj_bias=bool(hf.add_bias_linear),
        norm_eps=1e-5,  # fixed in the reference, whatever rms_norm_eps says
    )
    return ModelConfig(
        **_common(hf, arch),
        layers=tuple(layers),
        rms_norm_eps=hf.rms_norm_eps,
        attention=dataclasses.replace(attention, bias=False, sm_scale=(head_dim / 2) ** -0.5),
        mamba=mamba,
        mlp=MlpConfig(hf.intermediate_size, act, gated=True, bias=bool(hf.add_bias_linear)),
        moe=None,
        shared_block=SharedBlockConfig(
            min(hf.num_mem_blocks, uses), hf.adapter_rank, bool(hf.use_shared_attention_adapter)
        ),
    )


def _text_model(text_architecture: str) -> Callable[[PretrainedConfig], ModelConfig]:
    """A vision-language checkpoint served as its text model (`text_config`); whether the
    output projection is tied is the outer config's say, as in transformers."""

    def read(hf: PretrainedConfig) -> ModelConfig:
        text = getattr(hf, "text_config", None)
        if text is None:
            _fail(text_architecture, "text_config", None, "the text model's config")
        cfg = ARCHITECTURES[text_architecture](text)
        return dataclasses.replace(cfg, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))

    return read


ARCHITECTURES: dict[str, Callable[[PretrainedConfig], ModelConfig]] = {
    "LlamaForCausalLM": _llama,
    "Mamba2ForCausalLM": _mamba2,
    "BambaForCausalLM": _bamba,
    "GraniteMoeHybridForCausalLM": _granite_moe_hybrid,
    "NemotronHForCausalLM": _nemotron_h,
    "Qwen3NextForCausalLM": _qwen3_next,
    "Qwen3_5ForCausalLM": _qwen3_5,
    "Qwen3_5MoeForCausalLM": _qwen3_5_moe,
    "Lfm2ForCausalLM": _lfm2,
    "FalconH1ForCausalLM": _falcon_h1,
    "Zamba2ForCausalLM": _zamba2,
    "JambaForCausalLM": _jamba,
    "Qwen3_5ForConditionalGeneration": _text_model("Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": _text_model("Qwen3_5MoeForCausalLM"),
}


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """Reads `config.json` from a Hugging Face model directory into a `ModelConfig`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: must be a JSON object")
    architectures = raw.get("architectures") or []
    if not architectures:
        raise ValueError(f"{path}: 'architectures' is missing; supported: {', '.join(ARCHITECTURES)}")
    architecture = architectures[0]
    if architecture not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {architecture!r}; supported: {', '.join(ARCHITECTURES)}")
    hf = AutoConfig.from_pretrained(str(model_dir))
    cfg = ARCHITECTURES[architecture](hf)
    return _with_mtp(cfg, getattr(hf, "text_config", None) or hf)


def _with_mtp(cfg: ModelConfig, hf: PretrainedConfig) -> ModelConfig:
    """Adds the MTP module's layers a config declares (`mtp_num_hidden_layers`, Qwen3-Next and
    Qwen3.5; jaxengine reads the same field for its other attention models): full-attention
    decoder layers of the model's own kind, with a MoE feed-forward where the model's
    layers have one."""
    if cfg.architecture == "NemotronHForCausalLM":
        return _nemotron_h_mtp(cfg, hf)
    n = getattr(hf, "mtp_num_hidden_layers", 0) or 0
    if not n:
        return cfg
    if cfg.attention is None:
        _fail(
            cfg.architecture,
            "mtp_num_hidden_layers",
            n,
            "0 (jaxengine reads MTP modules of attention models in the Qwen3-Next format)",
        )
    if n != 1:
        _fail(cfg.architecture, "mtp_num_hidden_layers", n, "1")
    ffn = "moe" if any(spec.ffn == "moe" for spec in cfg.layers) else "mlp"
    return dataclasses.replace(cfg, mtp_layers=(LayerSpec("attention", ffn),))


def _nemotron_h_mtp(cfg: ModelConfig, hf: PretrainedConfig) -> ModelConfig:
    """Nemotron-H's MTP layers (`num_nextn_predict_layers`, of the kinds `mtp_layers_block_type`
    lists): a full-attention layer, then feed-forward layers, each with its own norm."""
    n = getattr(hf, "num_nextn_predict_layers", 0) or 0
    if not n:
        return cfg
    if n != 1:
        _fail(cfg.architecture, "num_nextn_predict_layers", n, "0 or 1")
    kinds = list(hf.mtp_layers_block_type)
    ffn_kinds = ("mlp", "moe") if cfg.moe is not None else ("mlp",)
    if not kinds or kinds[0] != "full_attention" or any(kind not in ffn_kinds for kind in kinds[1:]):
        _fail(
            cfg.architecture,
            "mtp_layers_block_type",
            kinds,
            f"'full_attention' followed by any of {', '.join(map(repr, ffn_kinds))}",
        )
    layers = [LayerSpec("attention", None), *(LayerSpec(None, kind) for kind in kinds[1:])]
    return dataclasses.replace(cfg, mtp_layers=tuple(layers))


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype `config.json` says the weights were saved in ("float32" when it says none,
    or one jaxengine does not compute in): what engine argument dtype="auto" means."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    saved = raw.get("dtype") or raw.get("torch_dtype") or text.get("dtype") or text.get("torch_dtype")
    return saved if saved in ("float32", "bfloat16", "float16") else "float32"
