"""Train the small hybrid attention + Mamba2 model embedded in jaxengine.

The default model is a tiny ``BambaForCausalLM`` (Hugging Face transformers) trained
on CPU on the Python standard library's own source code. It exists so that the engine
has a real, self-contained checkpoint for tests and demos: its samples look like
Python, and its per-token loss on a held-out chunk of stdlib source can be compared
between the JAX implementation and the PyTorch reference.

Steps:
  1. Collect the stdlib ``*.py`` files (sorted, tests and generated files excluded) and
     split them into training and held-out modules by sorted index.
  2. Train a byte-level BPE tokenizer on the training modules.
  3. Train the model on 256-token windows packed from the training modules, with
     AdamW and a warmup + cosine learning-rate schedule, until ``--steps`` or
     ``--max-minutes`` is reached (the schedule follows whichever comes first).
  4. Measure the held-out loss, write sample completions, and save the model,
     tokenizer, ``heldout_sample.txt`` and ``training_summary.json``.

Usage:
  python scripts/train_default_model.py --out jaxengine/assets/default_model

Training uses one CPU thread by default (``--threads`` to change) and stops after
25 minutes (``--max-minutes``). Runs are seeded; with a time budget, the number of
steps (and therefore the exact weights) depends on the machine's speed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import random
import sysconfig
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import BambaConfig, BambaForCausalLM, PreTrainedTokenizerFast

LOG = logging.getLogger("train_default_model")

SPECIAL_TOKEN = "<|endoftext|>"
EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "lib2to3", "site-packages", "pydoc_data", "__pycache__"})
MAX_FILE_BYTES = 256_000
SAMPLE_PROMPTS = ("def ", "import os\n", "class ", "    def __init__(self")


@dataclass(frozen=True)
class SourceFile:
    """One stdlib module: its path relative to the stdlib root and its text."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The training and held-out splits of the stdlib source."""

    train: list[SourceFile]
    heldout: list[SourceFile]

    @staticmethod
    def num_bytes(files: list[SourceFile]) -> int:
        return sum(len(f.text.encode("utf-8")) for f in files)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("jaxengine/assets/default_model"))
    parser.add_argument("--max-minutes", type=float, default=25.0, help="training wall-clock budget")
    parser.add_argument("--steps", type=int, default=None, help="maximum optimizer steps (default: time-bound)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch and tokenizers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="final LR as a fraction of the peak")
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--heldout-every", type=int, default=50, help="hold out every Nth module (sorted)")
    parser.add_argument("--heldout-windows", type=int, default=64, help="held-out windows for the final loss")
    parser.add_argument("--max-corpus-mb", type=float, default=32.0, help="subsample training modules above this")
    parser.add_argument("--sample-tokens", type=int, default=64, help="new tokens per sample completion")
    return parser.parse_args()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def is_corpus_file(path: Path, root: Path) -> bool:
    """Keep hand-written stdlib modules; drop tests, tools, and generated tables."""
    relative = path.relative_to(root)
    if EXCLUDED_DIRS.intersection(relative.parts[:-1]) or path.name.startswith("_sysconfigdata"):
        return False
    size = path.stat().st_size
    if size == 0 or size > MAX_FILE_BYTES:
        return False
    with path.open("rb") as handle:
        return b"gencodec.py" not in handle.read(1024)


def load_corpus(heldout_every: int, max_corpus_bytes: int) -> Corpus:
    """Read the stdlib source in sorted order and split it into train / held-out modules."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if is_corpus_file(p, root))
    files = [SourceFile(p.relative_to(root).as_posix(), p.read_text(encoding="utf-8", errors="replace")) for p in paths]
    heldout = [f for i, f in enumerate(files) if i % heldout_every == 0]
    train = [f for i, f in enumerate(files) if i % heldout_every != 0]
    stride = math.ceil(Corpus.num_bytes(train) / max_corpus_bytes)
    return Corpus(train=train[::stride], heldout=heldout)


def train_tokenizer(files: list[SourceFile], vocab_size: int) -> Tokenizer:
    """Byte-level BPE that prepends the special token (as BOS) to every encoded text."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((f.text for f in files), trainer=trainer)
    special_id = tokenizer.token_to_id(SPECIAL_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{SPECIAL_TOKEN} $A",
        pair=f"{SPECIAL_TOKEN} $A {SPECIAL_TOKEN} $B:1",
        special_tokens=[(SPECIAL_TOKEN, special_id)],
    )
    return tokenizer


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        model_max_length=2048,
    )


def token_stream(tokenizer: Tokenizer, files: list[SourceFile]) -> np.ndarray:
    """Concatenate the modules, each starting with the special token, into one id stream."""
    encodings = tokenizer.encode_batch([f.text for f in files])
    return np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])


def to_windows(stream: np.ndarray, seq_len: int) -> torch.Tensor:
    """Split a token stream into non-overlapping windows of ``seq_len`` tokens."""
    count = len(stream) // seq_len
    return torch.from_numpy(stream[: count * seq_len].reshape(count, seq_len))


def build_config(tokenizer: Tokenizer) -> BambaConfig:
    special_id = tokenizer.token_to_id(SPECIAL_TOKEN)
    return BambaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=6,
        attn_layer_indices=[1, 4],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=6,
        mamba_d_head=64,
        mamba_expand=2,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=special_id,
        eos_token_id=special_id,
        pad_token_id=special_id,
        dtype="float32",
    )


def build_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not norms, biases, or SSM scalars)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def learning_rate(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup over steps, then cosine decay over the fraction of the budget used."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def batches(windows: torch.Tensor, batch_size: int, rng: np.random.Generator) -> Iterator[torch.Tensor]:
    """Yield shuffled training batches forever, reshuffling at every epoch."""
    while True:
        order = rng.permutation(len(windows))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield windows[order[start : start + batch_size]]


@dataclass(frozen=True)
class TrainResult:
    steps: int
    tokens_seen: int
    wall_time_s: float
    final_train_loss: float


def train(
    model: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    windows: torch.Tensor,
    args: argparse.Namespace,
) -> TrainResult:
    """Trains the parameters of `model` that require gradients on `loss_of(batch)` until
    `--steps` or `--max-minutes` (the LR schedule follows whichever comes first)."""
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    budget_s = args.max_minutes * 60.0
    rng = np.random.default_rng(args.seed)
    model.train()
    start = time.monotonic()
    recent_losses: deque[float] = deque(maxlen=args.log_every)
    step = 0
    for batch in batches(windows, args.batch_size, rng):
        elapsed = time.monotonic() - start
        progress = elapsed / budget_s if args.steps is None else max(elapsed / budget_s, step / args.steps)
        if progress >= 1.0:
            break
        lr = learning_rate(step, progress, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = loss_of(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        step += 1
        recent_losses.append(loss.item())
        if step % args.log_every == 0:
            elapsed = time.monotonic() - start
            tokens = step * args.batch_size * args.seq_len
            LOG.info(
                "step %5d  loss %.4f  lr %.2e  %.0f tok/s  %.1f min",
                step,
                np.mean(recent_losses),
                lr,
                tokens / elapsed,
                elapsed / 60.0,
            )
    return TrainResult(
        steps=step,
        tokens_seen=step * args.batch_size * args.seq_len,
        wall_time_s=time.monotonic() - start,
        final_train_loss=float(np.mean(recent_losses)),
    )


@torch.no_grad()
def mean_token_loss(model: BambaForCausalLM, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position of ``windows``."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        logits = model(input_ids=batch).logits[:, :-1]
        targets = batch[:, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        ).item()
        count += targets.numel()
    return total / count


def select_windows(windows: torch.Tensor, count: int) -> torch.Tensor:
    """Pick ``count`` windows spread evenly over the held-out stream."""
    if len(windows) <= count:
        return windows
    return windows[np.linspace(0, len(windows) - 1, count).round().astype(np.int64)]


def heldout_excerpt(files: list[SourceFile], target_chars: int = 4096) -> tuple[str, str]:
    """About ``target_chars`` of whole lines from the middle of the largest held-out module."""
    source = max(files, key=lambda f: len(f.text))
    lines = source.text.splitlines(keepends=True)
    excerpt: list[str] = []
    size = 0
    for line in lines[len(lines) // 2 :]:
        if size + len(line) > target_chars:
            break
        excerpt.append(line)
        size += len(line)
    return source.name, "".join(excerpt)


@torch.no_grad()
def complete(
    model: BambaForCausalLM, tokenizer: PreTrainedTokenizerFast, prompt: str, new_tokens: int, sample: bool
) -> str:
    model.eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    options = {"do_sample": True, "temperature": 0.8, "top_p": 0.95, "top_k": 0} if sample else {"do_sample": False}
    output = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **options,
    )
    return tokenizer.decode(output[0], skip_special_tokens=True)


def sample_completions(
    model: BambaForCausalLM, tokenizer: PreTrainedTokenizerFast, new_tokens: int, seed: int
) -> list[dict[str, str]]:
    torch.manual_seed(seed)
    return [
        {
            "prompt": prompt,
            "mode": mode,
            "completion": complete(model, tokenizer, prompt, new_tokens, mode == "sampled"),
        }
        for prompt in SAMPLE_PROMPTS
        for mode in ("greedy", "sampled")
    ]


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    torch.set_num_threads(args.threads)
    seed_everything(args.seed)

    corpus = load_corpus(args.heldout_every, int(args.max_corpus_mb * 1e6))
    LOG.info(
        "corpus: %d train modules (%.2f MB), %d held-out modules (%.2f MB)",
        len(corpus.train),
        Corpus.num_bytes(corpus.train) / 1e6,
        len(corpus.heldout),
        Corpus.num_bytes(corpus.heldout) / 1e6,
    )
    raw_tokenizer = train_tokenizer(corpus.train, args.vocab_size)
    tokenizer = wrap_tokenizer(raw_tokenizer)
    train_windows = to_windows(token_stream(raw_tokenizer, corpus.train), args.seq_len)
    heldout_windows = select_windows(
        to_windows(token_stream(raw_tokenizer, corpus.heldout), args.seq_len), args.heldout_windows
    )
    LOG.info("tokens: %d train windows, %d held-out windows", len(train_windows), len(heldout_windows))

    model = BambaForCausalLM(build_config(raw_tokenizer))
    num_params = sum(p.numel() for p in model.parameters())
    LOG.info("model: %d parameters", num_params)

    result = train(model, lambda batch: model(input_ids=batch, labels=batch).loss, train_windows, args)
    heldout_loss = mean_token_loss(model, heldout_windows, args.batch_size)
    sample_name, sample_text = heldout_excerpt(corpus.heldout)
    sample_ids = tokenizer(sample_text, return_tensors="pt").input_ids
    sample_loss = mean_token_loss(model, sample_ids, 1)
    LOG.info("held-out loss %.4f, heldout_sample.txt loss %.4f", heldout_loss, sample_loss)

    samples = sample_completions(model, tokenizer, args.sample_tokens, args.seed)
    for entry in samples:
        LOG.info("[%s] %r\n%s\n", entry["mode"], entry["prompt"], entry["completion"])

    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    model_file_bytes = (args.out / "model.safetensors").stat().st_size
    (args.out / "heldout_sample.txt").write_text(sample_text, encoding="utf-8")
    summary = {
        "corpus": {
            "source": f"Python {platform.python_version()} standard library",
            "train_bytes": Corpus.num_bytes(corpus.train),
            "heldout_bytes": Corpus.num_bytes(corpus.heldout),
            "num_train_files": len(corpus.train),
            "num_heldout_files": len(corpus.heldout),
            "heldout_files": [f.name for f in corpus.heldout],
            "train_tokens": train_windows.numel(),
        },
        "tokenizer": {"vocab_size": raw_tokenizer.get_vocab_size(), "special_token": SPECIAL_TOKEN, "adds_bos": True},
        "parameter_count": num_params,
        "model_file_bytes": model_file_bytes,
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "wall_time_s": round(result.wall_time_s, 1),
        "final_train_loss": result.final_train_loss,
        "heldout_loss": heldout_loss,
        "heldout_windows": len(heldout_windows),
        "heldout_sample": {"file": sample_name, "tokens": sample_ids.shape[1], "loss": sample_loss},
        "hyperparameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "samples": samples,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    LOG.info("saved to %s", args.out)


if __name__ == "__main__":
    main()
