"""Output tokens/s with and without speculative decoding, side by side.

The engine runs the embedded default model (a Bamba hybrid; `--model DIR` for another) on the
Python snippets of `configs/prompts/python_starts.jsonl`, once without speculation and once
with each `--methods` configuration, at each batch size, greedy and at temperature 0.7 (top-p
0.95). Every request produces exactly `--max-tokens` tokens (end-of-sequence ignored). Each
timed run gets fresh prompts (a snippet behind a unique comment line), so no run is served from
an earlier one's prefix cache; runs alternate between the engines, `--repeats` times, the
order reversed every other repeat (of two identical plain engines run in a fixed order, the
second measured 2.5-4.5% slower in three of four settings; `--methods plain-control` runs
such a pair). All engines are warmed up (every step shape compiled) before timing. A run
takes well under a second, and on a shared machine one run in a few is slowed by others'
work: many repeats, and the ratio taken per repeat (each speculative run against the plain
run beside it) and then its median, keep such runs from deciding a ratio.
Each speculative configuration runs in a process of its own beside a plain engine (XLA:CPU
holds every compiled step of a process in memory: three warmed-up engines did not fit).
Engine settings are the defaults but for `max_num_seqs` (the largest batch; 16 is also the
default), when given `--max-model-len`, and two that only change start-up: every step shape
is compiled before serving (`background_compile=False`, so no timed step waits for or runs in
place of a compile) and none is stored (`compilation_cache_dir=None`, see `run`).

`--pad-layers N` serves a larger target instead: the model with N more Mamba2 layers whose
output projections (mixer and feed-forward) are zero. Each computes as a full layer but adds
nothing, so the target costs about N / 6 times more per token (for the default model) while
predicting exactly as the model: with `draft-default-*` the embedded default model drafts for
it with every greedy draft accepted (a bound on what a draft of that acceptance gains), and
its MTP module serves it as well as the model.

Reported per row: output tokens/s of each engine (batch * max_tokens / wall time of one
`generate` call, prefill included; the median of the repeats), the ratio speculative / plain
(the median of the repeats' ratios), and the speculative engine's
acceptance rate (accepted / drafted tokens) and mean accepted length (tokens emitted per
verifying sequence-step, the bonus token included) over its timed runs.

Usage (from the repository root):
  PYTHONPATH=. python scripts/bench_spec_decode.py --batch-sizes 1 16 --max-tokens 96 --json bench_spec_decode.json
  PYTHONPATH=. python scripts/bench_spec_decode.py --pad-layers 66 --methods draft-default-k3 mtp-k2 --json padded.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxengine import LLM, SamplingParams
from jaxengine.run_config import DEFAULT_MODEL

PROMPTS = Path(__file__).resolve().parents[1] / "configs" / "prompts" / "python_starts.jsonl"
# vLLM's documented ngram example and a shorter lookahead, as a user sets them (speculation
# `adaptive`: on only while it pays); and the example drafting at every step (verify steps' own cost).
METHODS = {
    "ngram-k5": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4},
    "ngram-k3": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2},
    "ngram-k5-always": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "adaptive": False},
    # The model's own MTP module (the default model has one, `scripts/train_default_mtp.py`).
    "mtp-k2": {"method": "mtp", "num_speculative_tokens": 2},
    "mtp-k3": {"method": "mtp", "num_speculative_tokens": 3},
    "mtp-k2-always": {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False},
    # The embedded default model as a draft model (for itself, or for a `--pad-layers` target).
    "draft-default-k3": {"method": "draft_model", "model": str(DEFAULT_MODEL), "num_speculative_tokens": 3},
    "draft-default-k3-always": {
        "method": "draft_model",
        "model": str(DEFAULT_MODEL),
        "num_speculative_tokens": 3,
        "adaptive": False,
    },
    # No speculation: a second plain engine, whose ratio shows what the measurement itself gives.
    "plain-control": None,
}
SAMPLING = {"greedy": dict(temperature=0.0), "t0.7": dict(temperature=0.7, top_p=0.95)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=sorted(METHODS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument(
        "--pad-layers",
        type=int,
        default=0,
        help="serve the model with this many zero-output Mamba2 layers added (see above)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engines' max_model_len (default: the engine's own, as a user gets it)",
    )
    parser.add_argument("--json", type=Path, default=Path("bench_spec_decode.json"))
    return parser.parse_args()


def snippets() -> list[str]:
    return [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]


def fresh_prompts(batch: int, run: int) -> list[str]:
    base = snippets()
    return [f"# run {run}, request {i}\n{base[i % len(base)]}" for i in range(batch)]


def padded_model(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """`model_dir` (a Bamba model) with `num_layers` more layers, copies of its first Mamba2
    layer with `mamba.out_proj` and `feed_forward.down_proj` zero: the same predictions."""
    config = json.loads((model_dir / "config.json").read_text())
    first = min(set(range(config["num_hidden_layers"])) - set(config["attn_layer_indices"]))
    tensors = load_file(model_dir / "model.safetensors")
    prefix = f"model.layers.{first}."
    for i in range(config["num_hidden_layers"], config["num_hidden_layers"] + num_layers):
        for name, tensor in [(n, t) for n, t in tensors.items() if n.startswith(prefix)]:
            zero = name.endswith(("mamba.out_proj.weight", "feed_forward.down_proj.weight"))
            tensors[f"model.layers.{i}.{name[len(prefix) :]}"] = np.zeros_like(tensor) if zero else tensor.copy()
    config["num_hidden_layers"] += num_layers
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outs)
    return len(prompts) * params.max_tokens / wall


def main() -> None:
    args = parse_args()
    if len(args.methods) > 1:
        return run_each_method_alone(args)
    if args.pad_layers:
        with tempfile.TemporaryDirectory() as tmp:
            args.model = padded_model(args.model, args.pad_layers, Path(tmp) / "padded")
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> None:
    # No stored steps: on XLA:CPU, steps loaded from files fail once the process compiles
    # others, and the engines here compile different shapes.
    engine_args = dict(
        max_num_seqs=max(args.batch_sizes),
        max_model_len=args.max_model_len,
        background_compile=False,
        compilation_cache_dir=None,
    )
    plain = LLM(args.model, **engine_args)
    specs = {name: LLM(args.model, speculative_config=METHODS[name], **engine_args) for name in args.methods}
    rows, run = [], 0
    for batch in args.batch_sizes:
        for label, sampling in SAMPLING.items():
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0, **sampling)
            for llm in (plain, *specs.values()):  # untimed: first steps of these shapes
                timed(llm, fresh_prompts(batch, run := run + 1), params)
            before = {name: llm.stats() for name, llm in specs.items()}
            speeds: dict[str, list[float]] = {"plain": [], **{name: [] for name in specs}}
            engines = [("plain", plain), *specs.items()]
            for repeat in range(args.repeats):
                for name, llm in engines if repeat % 2 == 0 else engines[::-1]:  # each engine in turn first and last
                    speeds[name].append(timed(llm, fresh_prompts(batch, run := run + 1), params))
            base = statistics.median(speeds["plain"])
            for name, llm in specs.items():
                now, then = llm.stats(), before[name]
                drafted = now.get("spec_draft_tokens", 0) - then.get("spec_draft_tokens", 0)
                accepted = now.get("spec_accepted_tokens", 0) - then.get("spec_accepted_tokens", 0)
                verifies = now.get("spec_verifies", 0) - then.get("spec_verifies", 0)
                spec = statistics.median(speeds[name])
                ratio = statistics.median(s / p for s, p in zip(speeds[name], speeds["plain"]))
                rows.append(
                    dict(
                        batch=batch,
                        sampling=label,
                        method=name,
                        plain_tokens_per_s=base,
                        spec_tokens_per_s=spec,
                        ratio=ratio,
                        acceptance_rate=accepted / drafted if drafted else 0.0,
                        mean_accepted_length=1 + accepted / verifies if verifies else 1.0,
                    )
                )
                print(
                    f"batch {batch:3d} {label:6s} {name:9s} plain {base:8.1f} tok/s  spec {spec:8.1f} tok/s  "
                    f"ratio {ratio:5.2f}  acceptance {rows[-1]['acceptance_rate']:.2f}  "
                    f"mean accepted length {rows[-1]['mean_accepted_length']:.2f}"
                )
    report = dict(
        date=datetime.date.today().isoformat(),
        machine=platform.processor() or platform.machine(),
        cpus=jax.local_device_count(),
        jax=jax.__version__,
        model=str(args.model),
        pad_layers=args.pad_layers,
        max_tokens=args.max_tokens,
        repeats=args.repeats,
        max_model_len=args.max_model_len,
        methods={m: METHODS[m] for m in specs},
        rows=rows,
    )
    args.json.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.json}")


def run_each_method_alone(args: argparse.Namespace) -> None:
    """Runs this script once per method, each in its own process, and merges their reports."""
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.methods:
            out = Path(tmp) / f"{name}.json"
            command = [
                sys.executable,
                __file__,
                "--model",
                str(args.model),
                "--methods",
                name,
                "--batch-sizes",
                *map(str, args.batch_sizes),
                "--max-tokens",
                str(args.max_tokens),
                "--repeats",
                str(args.repeats),
                "--pad-layers",
                str(args.pad_layers),
                "--json",
                str(out),
            ]
            if args.max_model_len is not None:
                command += ["--max-model-len", str(args.max_model_len)]
            subprocess.run(command, check=True)
            reports.append(json.loads(out.read_text()))
    merged = {
        **reports[0],
        "methods": {m: METHODS[m] for m in args.methods},
        "rows": [row for report in reports for row in report["rows"]],
    }
    args.json.write_text(json.dumps(merged, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
