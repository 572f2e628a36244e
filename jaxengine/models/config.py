"""Model configuration: one frozen dataclass that every supported architecture maps onto.

A model is a stack of layers, each with an optional *mixer* (attention, Mamba2, Mamba-1,
Gated DeltaNet or a short convolution; Falcon-H1 runs two side by side) and an optional
*feed-forward* (gated MLP, squared-ReLU MLP, or mixture of experts), both pre-norm residual
branches. Each architecture family (`arch/`) reads its Hugging Face config into this
schema; the model code only ever sees `ModelConfig`.
"""

import dataclasses
from typing import Literal

# A key of `mixers.py`'s MIXERS ("attention", "mamba", ...); `arch.load_model_config` rejects
# any other.
Mixer = str
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
    them into the projection weights and biases (`arch/falcon_h1.py`); the model code never sees
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
