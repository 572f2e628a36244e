"""Reading a Hugging Face config: the pieces several families share.

Each reader takes the transformers config and the architecture's name, and raises a
ValueError naming the architecture, the config.json field and what is supported (`fail`) for
a value jaxengine does not run.
"""

import math
from typing import Any

from transformers import PretrainedConfig

from jaxengine.models.config import AttentionConfig, MambaConfig, Mixer


def fail(architecture: str, field: str, value: Any, supported: str) -> None:
    raise ValueError(f"{architecture}: unsupported value {field}={value!r}; supported: {supported}")


def _rope(hf: PretrainedConfig, head_dim: int, architecture: str) -> tuple[int, float]:
    """(rotary_dim, theta) from `rope_parameters` (or the older top-level `rope_theta`)."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        fail(architecture, "rope_parameters.rope_type", rope_type, "'default'")
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    factor = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    return int(head_dim * factor), theta


def attention_config(
    hf: PretrainedConfig, architecture: str, *, use_rope: bool, head_dim: int | None = None
) -> AttentionConfig:
    """Grouped-query attention from the usual fields (`num_attention_heads`,
    `num_key_value_heads`, `head_dim`, `attention_bias`, the rotary embedding's)."""
    head_dim = head_dim or getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rotary_dim, theta = _rope(hf, head_dim, architecture) if use_rope else (0, 10000.0)
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if hf.num_attention_heads % num_kv_heads:
        fail(
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


def activation(hf: PretrainedConfig, field: str, architecture: str, supported: tuple[str, ...]) -> str:
    act = getattr(hf, field)
    if act not in supported:
        fail(architecture, field, act, ", ".join(supported))
    return act


def time_step_limit(value: Any) -> tuple[float, float]:
    """(low, high) from a list of two numbers, either possibly JSON-encoded as {"__float__": ...}."""
    low, high = (float(v) if not isinstance(v, dict) else float(v["__float__"]) for v in value)
    return low, high


def bamba_like_mamba(hf: PretrainedConfig, architecture: str) -> MambaConfig:
    """A Mamba2 mixer from the `mamba_*` fields of Bamba, Granite and Falcon-H1."""
    activation(hf, "hidden_act", architecture, ("silu",))
    num_heads = hf.mamba_n_heads
    head_dim = hf.mamba_d_head
    if head_dim == "auto" or head_dim is None:
        head_dim = hf.mamba_expand * hf.hidden_size // num_heads
    if num_heads % hf.mamba_n_groups:
        fail(architecture, "mamba_n_groups", hf.mamba_n_groups, f"a divisor of mamba_n_heads={num_heads}")
    return MambaConfig(
        num_heads=num_heads,
        head_dim=int(head_dim),
        state_size=hf.mamba_d_state,
        n_groups=hf.mamba_n_groups,
        conv_kernel=hf.mamba_d_conv,
        chunk_size=hf.mamba_chunk_size,
        time_step_limit=time_step_limit(hf.time_step_limit or (0.0, math.inf)),
        conv_bias=bool(hf.mamba_conv_bias),
        proj_bias=bool(hf.mamba_proj_bias),
        out_proj_bias=bool(hf.mamba_proj_bias),
    )


def layer_mixers(types: list[str], architecture: str, field: str) -> list[Mixer]:
    """Per-layer mixers from Bamba's and Granite's layer types: attention or Mamba2."""
    table = {"full_attention": "attention", "linear_attention": "mamba"}
    for t in types:
        if t not in table:
            fail(architecture, field, t, ", ".join(table))
    return [table[t] for t in types]


def _eos(hf: PretrainedConfig) -> tuple[int, ...]:
    eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def common_fields(hf: PretrainedConfig, architecture: str) -> dict[str, Any]:
    """The `ModelConfig` fields every transformers config spells alike."""
    return dict(
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096) or 4096),
        eos_token_ids=_eos(hf),
    )
