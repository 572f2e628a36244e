"""A multi-token-prediction (MTP) module for the tiny test models, in Qwen3-Next's format (or
Nemotron-H's), and its drafts computed in torch without any cache: the reference for the
engine's `mtp` method.

The module's decoder layer is a copy of the model's first attention layer with its weights
redrawn, so the same transformers class (norms, rotary embedding, gating) runs it; Nemotron-H's
module is a copy of its first attention block and of its first MoE block."""

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from tests.models.tiny_models import LOGIT_SCALE, _one_torch_thread


class TorchMtp(torch.nn.Module):
    """mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, mtp.layers.*, mtp.norm."""

    def __init__(self, model: PreTrainedModel, seed: int):
        super().__init__()
        cfg = model.config
        d = cfg.hidden_size
        eps = getattr(cfg, "rms_norm_eps", None) or cfg.layer_norm_epsilon
        gen = torch.Generator().manual_seed(seed)
        norm_cls = type(_final_norm(model))
        self.pre_fc_norm_embedding = norm_cls(d, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(d, eps=eps)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        self.layers = torch.nn.ModuleList([copy.deepcopy(layer) for layer in _mtp_layers(model)])
        self.norm = norm_cls(d, eps=eps)
        with torch.no_grad():
            self.fc.weight.copy_(0.1 * torch.randn(self.fc.weight.shape, generator=gen))
            for name, p in self.named_parameters():
                if name != "fc.weight":  # redraw the copied layer; norm weights get noise like the model's
                    p.add_(0.3 * torch.randn(p.shape, generator=gen) * (1.0 if "norm" in name else p.std()))
            self.norm.weight.mul_(LOGIT_SCALE)
        self.eval()


def _final_norm(model: PreTrainedModel) -> torch.nn.Module:
    inner = model.model
    return next(getattr(inner, name) for name in ("norm", "final_layernorm", "norm_f") if hasattr(inner, name))


def _is_nemotron(model: PreTrainedModel) -> bool:
    return model.config.model_type == "nemotron_h"


def _mtp_layers(model: PreTrainedModel) -> list[torch.nn.Module]:
    """Nemotron-H: its first attention block and first MoE block; else its first attention layer."""
    if _is_nemotron(model):
        kinds = [layer.block_type for layer in model.model.layers]
        return [model.model.layers[kinds.index("full_attention")], model.model.layers[kinds.index("moe")]]
    return [next(layer for layer in model.model.layers if hasattr(layer, "self_attn"))]


def _checkpoint_name(name: str, num_layers: int) -> str:
    """A TorchMtp parameter's tensor name: Qwen3-Next's `mtp.<name>`, or Nemotron-H's names for
    the norms and the input projection (mtp.layers.0.enorm, ...)."""
    nemotron = {
        "pre_fc_norm_embedding.weight": "layers.0.enorm.weight",
        "pre_fc_norm_hidden.weight": "layers.0.hnorm.weight",
        "fc.weight": "layers.0.eh_proj.weight",
        "norm.weight": f"layers.{num_layers - 1}.final_layernorm.weight",
    }
    return "mtp." + (nemotron.get(name, name) if num_layers > 1 else name)


def add_tiny_mtp(model: PreTrainedModel, path: str | Path, *, seed: int = 1) -> TorchMtp:
    """Adds an MTP module to the model saved at `path` (its `mtp.*` tensors and
    `mtp_num_hidden_layers: 1` in config.json; Nemotron-H: `num_nextn_predict_layers: 1` and
    `mtp_layers_block_type`) and returns it."""
    path = Path(path)
    mtp = TorchMtp(model, seed)
    tensors = load_file(path / "model.safetensors")
    tensors.update({_checkpoint_name(k, len(mtp.layers)): v.contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    if _is_nemotron(model):
        config.update(num_nextn_predict_layers=1, mtp_layers_block_type=[layer.block_type for layer in mtp.layers])
    else:
        config["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return mtp


@torch.no_grad()
@_one_torch_thread()
def reference_drafts(model: PreTrainedModel, mtp: TorchMtp, tokens: list[int], k: int) -> list[int]:
    """The module's k greedy drafts after `tokens` (its last one the pending token): at each
    position t of the computed tokens, input (embed(token t + 1), the model's final hidden
    state h_t); then each draft's own (embed(draft), g) at the next position. Full causal
    forwards, no cache."""
    computed = torch.tensor([tokens[:-1]])
    hidden = model.model(computed).last_hidden_state  # [1, N, D], after the final norm
    embed = model.get_input_embeddings()
    xs = mtp.fc(
        torch.cat(
            [mtp.pre_fc_norm_embedding(embed(torch.tensor([tokens[1:]]))), mtp.pre_fc_norm_hidden(hidden)], dim=-1
        )
    )
    drafts = []
    for _ in range(k):
        g = mtp.norm(_layers_forward(model, mtp.layers, xs))[:, -1]  # [1, D]
        draft = int(model.lm_head(g).argmax(-1))
        drafts.append(draft)
        x = mtp.fc(
            torch.cat(
                [mtp.pre_fc_norm_embedding(embed(torch.tensor([[draft]]))), mtp.pre_fc_norm_hidden(g[:, None])], dim=-1
            )
        )
        xs = torch.cat([xs, x], dim=1)
    return drafts


def _layers_forward(model: PreTrainedModel, layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    """Decoder layers over x [1, T, D] with a causal mask and the model's rotary embedding (if any)."""
    n = x.shape[1]
    positions = torch.arange(n)[None]
    kwargs = dict(attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None], position_ids=positions)
    if hasattr(model.model, "rotary_emb"):
        kwargs["position_embeddings"] = model.model.rotary_emb(x, positions)
    for layer in layers:
        out = layer(x, **kwargs)
        x = out[0] if isinstance(out, tuple) else out
    return x
