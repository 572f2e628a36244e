"""Train the multi-token-prediction (MTP) draft module of the embedded default model.

The module is Qwen3-Next's format (`mtp.*` tensors; `jaxengine/models/mtp.py`): at position t
it reads the model's final hidden state h_t and the embedding of token t + 1, runs one
attention decoder layer of the model's own kind and predicts token t + 2 through the model's
(tied) output projection. The model itself stays frozen; only the module trains, on the same
stdlib windows as the model (`train_default_model.py`), tokenized with the saved tokenizer.
Its layer starts as a copy of the model's last attention layer and `fc` as the hidden-state
pass-through, so it starts as a next-token predictor and learns to look one token further.

Usage:
  python scripts/train_default_mtp.py --out jaxengine/assets/default_model --max-minutes 10

It writes the `mtp.*` tensors into `model.safetensors`, `mtp_num_hidden_layers: 1` into
`config.json` and an "mtp" section (held-out loss and top-1 accuracy of the drafted token)
into `training_summary.json`. Rerunning replaces the module.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from train_default_model import load_corpus, seed_everything, select_windows, to_windows, token_stream, train
from transformers import BambaForCausalLM

LOG = logging.getLogger("train_default_mtp")


class MtpModule(torch.nn.Module):
    """pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.0, norm (named as saved)."""

    def __init__(self, model: BambaForCausalLM):
        super().__init__()
        cfg = model.config
        d = cfg.hidden_size
        norm_cls = type(model.model.final_layernorm)
        self.pre_fc_norm_embedding = norm_cls(d, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(d, eps=cfg.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * d, d, bias=False)
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, d:] = torch.eye(d)
        attention = [layer for layer in model.model.layers if hasattr(layer, "self_attn")][-1]
        self.layers = torch.nn.ModuleList([copy.deepcopy(attention)])
        self.norm = copy.deepcopy(model.model.final_layernorm)
        for p in self.parameters():
            p.requires_grad_(True)

    def forward(self, model: BambaForCausalLM, next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """next_ids [B, L] (token t + 1), hidden [B, L, D] (h_t) -> logits for token t + 2 [B, L, V]."""
        embed = model.get_input_embeddings()(next_ids)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embed), self.pre_fc_norm_hidden(hidden)], dim=-1))
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.layers[0](
            hidden_states=x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=model.model.rotary_emb(x, positions),
        )
        out = out[0] if isinstance(out, tuple) else out
        return model.lm_head(self.norm(out))


def mtp_loss(model: BambaForCausalLM, mtp: MtpModule, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of token t + 2 and the number of positions whose top-1 draft is right."""
    with torch.no_grad():
        hidden = model.model(batch).last_hidden_state  # [B, L, D], after the final norm
    logits = mtp(model, batch[:, 1:-1], hidden[:, :-2])  # positions 0..L-3 predict tokens 2..L-1
    targets = batch[:, 2:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return loss, (logits.argmax(-1) == targets).sum()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("jaxengine/assets/default_model"))
    parser.add_argument("--max-minutes", type=float, default=10.0, help="training wall-clock budget")
    parser.add_argument("--steps", type=int, default=None, help="maximum optimizer steps (default: time-bound)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--heldout-every", type=int, default=50)
    parser.add_argument("--heldout-windows", type=int, default=64)
    parser.add_argument("--max-corpus-mb", type=float, default=32.0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    tokenizer = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    corpus = load_corpus(args.heldout_every, int(args.max_corpus_mb * 1e6))
    train_windows = to_windows(token_stream(tokenizer, corpus.train), args.seq_len)
    heldout = select_windows(to_windows(token_stream(tokenizer, corpus.heldout), args.seq_len), args.heldout_windows)

    model = BambaForCausalLM.from_pretrained(args.out).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    mtp = MtpModule(model)
    result = train(mtp, lambda batch: mtp_loss(model, mtp, batch)[0], train_windows, args)

    mtp.eval()
    with torch.no_grad():
        results = [
            mtp_loss(model, mtp, heldout[i : i + args.batch_size]) for i in range(0, len(heldout), args.batch_size)
        ]
    positions = heldout.shape[0] * (heldout.shape[1] - 2)
    heldout_loss = float(np.mean([loss.item() for loss, _ in results]))
    accuracy = float(sum(right.item() for _, right in results)) / positions
    LOG.info("held-out MTP loss %.4f, top-1 accuracy of token t + 2: %.3f", heldout_loss, accuracy)

    tensors = {k: v for k, v in load_file(args.out / "model.safetensors").items() if not k.startswith("mtp.")}
    tensors.update({f"mtp.{k}": v.detach().contiguous() for k, v in mtp.state_dict().items()})
    save_file(tensors, args.out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((args.out / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    summary_path = args.out / "training_summary.json"
    summary = json.loads(summary_path.read_text())
    summary["mtp"] = {
        "parameter_count": sum(p.numel() for p in mtp.parameters()),
        "steps": result.steps,
        "wall_time_s": round(result.wall_time_s, 1),
        "final_train_loss": result.final_train_loss,
        "heldout_loss": heldout_loss,
        "heldout_top1_accuracy": accuracy,
        "hyperparameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    summary_path.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    LOG.info("saved to %s", args.out)


if __name__ == "__main__":
    main()
