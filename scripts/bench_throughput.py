"""Output-token throughput of jaxengine against transformers' ``generate`` on CPU.

Both run the same model on the same random prompts: greedy decoding, end-of-sequence
ignored, every request producing exactly ``--max-tokens`` tokens. By default the model is
built here with seeded random weights and saved with ``save_pretrained`` to a temporary
directory: ``--arch bamba`` (the default) a ~35M-parameter ``BambaForCausalLM`` (attention +
Mamba2), ``--arch qwen3_5`` a ~30M-parameter ``Qwen3_5ForCausalLM`` (Gated DeltaNet + gated
attention, 3:1, Qwen3.5's head ratios), ``--arch jamba`` a ~32M-parameter
``JambaForCausalLM`` (Mamba-1 + attention, 3:1, two MoE layers of 4 experts, top 2);
``--model DIR`` benchmarks an existing model directory instead. transformers runs Qwen3.5's
Gated DeltaNet and Jamba's selective scan with its PyTorch fallbacks (what it does without
the flash-linear-attention and mamba-ssm packages, e.g. on any CPU).

For each batch size the script reports output tokens/s of both and their ratio, the time
to first token, the time per decode step, and the decode floor: the bytes of weights a
decode step must read (all parameter bytes; an upper bound for untied embeddings, of
which a step reads only a few rows) divided by the measured memory bandwidth (best of
several large numpy copies). jaxengine compiles every step shape before the timed runs;
its compile time is reported separately. Timed runs alternate between the two frameworks,
so load from other processes affects both alike, and the median of ``--repeats`` runs is
kept. Every run gets fresh prompts, so no run is served from a cache of an earlier one.

How each figure is measured:
  * output tokens/s: batch * max_tokens / wall time of one generate call (prefill included);
  * TTFT: jaxengine's mean over requests from its request outputs (a batch whose prompts
    exceed ``--max-num-batched-tokens`` is prefilled over several steps, so later requests
    wait longer); transformers' is a whole generate call with ``max_new_tokens=1``;
  * decode step: jaxengine's mean ``time_per_output_token`` (steps that also prefill other
    requests included); transformers' is (wall - TTFT) / (max_tokens - 1).

``--threads N`` pins the process to N CPUs (JAX sizes its thread pool from the affinity
mask) and sets torch to N threads; the default is every CPU the process may use. On a
machine shared with other jobs, torch's OpenMP threads slow down badly once the CPUs are
oversubscribed, and ``--threads 1`` gives steadier numbers for both frameworks. The JSON
records the load averages at the start and the end of the run, and whether the CPU malloc
settings were on (``JAXENGINE_MALLOC_TUNING=1``, see ``jaxengine/host_memory.py``; they also
apply to transformers, which runs in the same process).

``--max-model-len`` takes one or more values, a table row each; the default is the engine's
own (the model's ``max_position_embeddings`` up to 4096), what a user gets without setting it.

``--retention`` and ``--no-prefix-caching`` set jaxengine's prefix cache (default: on, dense
checkpoints, as a user gets it): fresh prompts never hit, so they measure what storing
checkpoints costs a step.

Usage (from the repository root; ``PYTHONPATH=.`` is not needed after ``pip install -e .``):
  PYTHONPATH=. python scripts/bench_throughput.py --batch-sizes 1 16 --prompt-len 128 --max-tokens 64 \\
      --max-model-len 192 1024 default --repeats 3 --json bench_throughput.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    BambaConfig,
    BambaForCausalLM,
    JambaConfig,
    JambaForCausalLM,
    PreTrainedModel,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
)

import jaxengine
from jaxengine import LLM, SamplingParams

SEED = 0
EMBED_SCALE = 10.0  # spreads the random model's logits so greedy picks are not near-ties
DT_BIAS = -3.0  # softplus(-3) ~ 0.05: small steps, so SSM states decay slowly
BANDWIDTH_BYTES = 512 * 2**20
BANDWIDTH_TRIALS = 5


@dataclasses.dataclass(frozen=True)
class Timing:
    """One framework's median timings at one batch size."""

    wall_s: float  # the whole generate call
    tokens_per_s: float  # output tokens / wall_s
    ttft_s: float  # mean time to first token
    decode_step_s: float  # mean time per decode step (per output token of one sequence)


# ---------------------------------------------------------------------------- set-up


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="an existing model directory (default: build a random --arch)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="bamba", help="the random model to build")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per framework and batch size (median kept)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU threads for both")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="jaxengine's token budget per step")
    parser.add_argument(
        "--max-model-len",
        nargs="+",
        default=["default"],
        help="jaxengine's max_model_len, one table row each: 'default' (what a user gets, the model's "
        "max_position_embeddings up to 4096) or a number of tokens",
    )
    parser.add_argument(
        "--retention",
        default="auto",
        help="jaxengine's prefix_cache_retention_interval: auto (the default: dense for this "
        "hybrid), dense, sparse or a number of tokens",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="run jaxengine with prefix caching off")
    parser.add_argument("--json", type=Path, default=Path("bench_throughput.json"))
    return parser.parse_args()


def limit_threads(threads: int) -> None:
    """Pins the process to `threads` CPUs (XLA sizes its thread pool from the affinity mask,
    so this must run before JAX's first computation) and gives torch as many threads."""
    cpus = sorted(os.sched_getaffinity(0))
    if threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])
    torch.set_num_threads(threads)


def warn_if_busy(threads: int, load: float) -> None:
    """Says when other jobs already keep the CPUs busy enough that torch's threads, which
    wait for each other at every parallel region, are likely to stall."""
    if threads > 1 and load + threads > os.cpu_count() + 1:
        print(
            f"warning: 1-minute load average {load:.1f} on {os.cpu_count()} CPUs; with {threads} threads torch may "
            "stall and its numbers (and the ratio) mean little; --threads 1 is steadier on a busy machine"
        )


# What both random models share: 8 layers, hidden 512, MLP 1536, vocab 8192, tied embeddings.
_COMMON = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    dtype="float32",
)


def bamba_config() -> BambaConfig:
    """2 attention and 6 Mamba2 layers, Mamba heads 16 x 64, state 64."""
    return BambaConfig(
        **_COMMON,
        attn_layer_indices=[2, 5],
        num_attention_heads=8,
        num_key_value_heads=4,
        mamba_n_heads=16,
        mamba_d_head=64,
        mamba_expand=2,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_chunk_size=64,
    )


def qwen3_5_config() -> Qwen3_5TextConfig:
    """6 Gated DeltaNet and 2 gated attention layers; DeltaNet 4 key heads and 8 value heads of
    64 (Qwen3.5's 1:2), a state of 8 x 64 x 64 per layer."""
    return Qwen3_5TextConfig(
        **_COMMON,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
    )


def jamba_config() -> JambaConfig:
    """6 Mamba-1 and 2 attention layers (attention at 2 and 6); Mamba-1 over 1024 channels,
    state 16, dt rank 32; MLP width 768, MoE (4 experts of 768, top 2) at layers 1 and 5."""
    return JambaConfig(
        **{**_COMMON, "intermediate_size": 768},
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=4,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=32,
    )


ARCHS = {
    "bamba": (BambaForCausalLM, bamba_config),
    "qwen3_5": (Qwen3_5ForCausalLM, qwen3_5_config),
    "jamba": (JambaForCausalLM, jamba_config),
}


@torch.no_grad()
def build_random_model(path: Path, arch: str) -> None:
    """Saves a seeded random model of `arch` to `path`, with slowly decaying recurrent states."""
    torch.manual_seed(SEED)
    cls, config = ARCHS[arch]
    model = cls(config()).eval()
    gen = torch.Generator().manual_seed(SEED)
    for name, p in model.named_parameters():
        noise = 0.3 * torch.randn(p.shape, generator=gen)
        if name.endswith(("dt_bias", "dt_proj.bias")):
            p.copy_(DT_BIAS + noise)
        elif name.endswith("A_log"):
            p.copy_(noise)  # A = -exp(A_log) ~ -1 for every head
        elif name.endswith("embed_tokens.weight"):
            p.mul_(EMBED_SCALE)
    model.save_pretrained(path)


def load_hf_model(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def parameter_bytes(model: PreTrainedModel) -> tuple[int, int]:
    """Parameter count and bytes; tied weights count once (a decode step reads them once)."""
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def model_summary(config: transformers.PretrainedConfig) -> dict[str, Any]:
    """The architecture and the sizes that matter for speed."""
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "attn_layer_indices",
        "num_attention_heads",
        "num_key_value_heads",
        "mamba_n_heads",
        "mamba_d_head",
        "mamba_d_state",
        "mamba_chunk_size",
        "tie_word_embeddings",
        "layer_types",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "attn_layer_period",
        "attn_layer_offset",
        "expert_layer_period",
        "expert_layer_offset",
        "num_experts",
        "num_experts_per_tok",
        "mamba_expand",
        "mamba_dt_rank",
    )
    summary = {"architecture": type(config).__name__.removesuffix("Config")}
    return summary | {f: getattr(config, f) for f in fields if hasattr(config, f)}


def memory_bandwidth() -> float:
    """Bytes/s of a large numpy copy (read + write counted), best of several trials."""
    src = np.ones(BANDWIDTH_BYTES // 8, np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(BANDWIDTH_TRIALS):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab, size=(batch, length)).tolist()


# ---------------------------------------------------------------------------- runs


def jaxengine_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[Any]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


@torch.inference_mode()
def hf_run(model: PreTrainedModel, input_ids: torch.Tensor, max_tokens: int) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return time.perf_counter() - start, out[:, input_ids.shape[1] :]


def bench_batch(
    llm: LLM, model: PreTrainedModel, batch: int, prompt_len: int, max_tokens: int, repeats: int
) -> dict[str, Any]:
    """Both frameworks at one batch size: an untimed warm-up run each, then `repeats` timed
    runs, alternating between the two (plus transformers' prefill-only runs for its TTFT).
    Every run gets fresh prompts, the same for both frameworks, so nothing is served from
    a cache of an earlier run."""
    vocab = model.config.vocab_size
    prompt_sets = [random_prompts(batch, prompt_len, vocab, seed=SEED + 1000 * batch + i) for i in range(repeats + 1)]
    _, jax_outs = jaxengine_run(llm, prompt_sets[0], max_tokens)
    _, hf_tokens = hf_run(model, torch.tensor(prompt_sets[0]), max_tokens)
    agree = sum(o.outputs[0].token_ids == t for o, t in zip(jax_outs, hf_tokens.tolist()))

    jax_walls, jax_ttfts, jax_steps, hf_walls, hf_ttfts = [], [], [], [], []
    compiled = llm.engine.runner.num_compiled_steps()  # the timed runs must not compile
    for prompts in prompt_sets[1:]:
        wall, outs = jaxengine_run(llm, prompts, max_tokens)
        jax_walls.append(wall)
        jax_ttfts.append(statistics.mean(o.time_to_first_token for o in outs))
        jax_steps.append(statistics.mean(o.time_per_output_token for o in outs))
        input_ids = torch.tensor(prompts)
        hf_walls.append(hf_run(model, input_ids, max_tokens)[0])
        hf_ttfts.append(hf_run(model, input_ids, 1)[0])
    recompiles = llm.engine.runner.num_compiled_steps() - compiled

    med = statistics.median
    tokens = batch * max_tokens
    jax_t = Timing(med(jax_walls), tokens / med(jax_walls), med(jax_ttfts), med(jax_steps))
    hf_wall, hf_ttft = med(hf_walls), med(hf_ttfts)
    hf_t = Timing(hf_wall, tokens / hf_wall, hf_ttft, (hf_wall - hf_ttft) / max(max_tokens - 1, 1))
    return {
        "batch_size": batch,
        "jaxengine": dataclasses.asdict(jax_t),
        "transformers": dataclasses.asdict(hf_t),
        "throughput_ratio": jax_t.tokens_per_s / hf_t.tokens_per_s,
        "greedy_outputs_identical": f"{agree}/{batch}",
        "jaxengine_recompiles_during_timing": recompiles,
        "raw": {"jaxengine_wall_s": jax_walls, "transformers_wall_s": hf_walls, "transformers_ttft_s": hf_ttfts},
    }


# ---------------------------------------------------------------------------- report


def machine_info(threads: int, load_start: tuple[float, ...]) -> dict[str, Any]:
    """Versions and the machine; the 1/5/15-minute load averages show how busy it was."""
    return {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "threads": threads,
        "torch_num_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "malloc_tuning": jaxengine.MALLOC_TUNED,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def add_floor(result: dict[str, Any], floor_s: float) -> None:
    """How far each framework's decode step is from the weight-streaming floor."""
    result["decode_floor_s"] = floor_s
    for name in ("jaxengine", "transformers"):
        result[name]["step_over_floor"] = result[name]["decode_step_s"] / floor_s


def format_table(results: list[dict[str, Any]]) -> str:
    header = (
        f"| {'max_model_len':>13} | {'batch':>5} | {'engine':<12} | {'output tok/s':>12} | {'TTFT ms':>8} | {'decode step ms':>14} "
        f"| {'step / floor':>12} | {'jaxengine / HF':>14} |"
    )
    rule = "|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|"
    lines = [header, rule]
    for r in results:
        for name in ("jaxengine", "transformers"):
            t = r[name]
            ratio = f"{r['throughput_ratio']:.2f}x" if name == "jaxengine" else ""
            lines.append(
                f"| {r['max_model_len']:>13} | {r['batch_size']:>5} | {name:<12} | {t['tokens_per_s']:>12.1f} | {t['ttft_s'] * 1e3:>8.1f} "
                f"| {t['decode_step_s'] * 1e3:>14.2f} | {t['step_over_floor']:>12.1f} | {ratio:>14} |"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    load_start = os.getloadavg()
    warn_if_busy(args.threads, load_start[0])
    model = load_hf_model(model_dir)
    num_params, param_bytes = parameter_bytes(model)
    print(
        f"model: {model_dir} ({type(model).__name__}, {num_params / 1e6:.1f}M parameters, {param_bytes / 1e6:.0f} MB)"
    )
    bandwidth = memory_bandwidth()
    floor_s = param_bytes / bandwidth
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s -> decode floor {floor_s * 1e3:.2f} ms/step")

    results, compiles = [], []
    for max_model_len in args.max_model_len:
        llm = LLM(
            model_dir,
            dtype="float32",
            max_num_seqs=max(args.batch_sizes),
            max_num_batched_tokens=args.max_num_batched_tokens,
            page_size=16,
            warm_up=True,
            background_compile=False,  # every shape compiled before the timed runs
            enable_prefix_caching=not args.no_prefix_caching,
            prefix_cache_retention_interval=RETENTIONS.get(args.retention, args.retention),
            **({} if max_model_len == "default" else {"max_model_len": int(max_model_len)}),
        )
        resolved = llm.engine.max_model_len
        shapes = len(llm.engine.shapes())
        print(
            f"max_model_len {max_model_len} ({resolved}): jaxengine compiled {shapes} step shapes in "
            f"{llm.engine.compile_seconds:.1f} s"
        )
        compiles.append(
            {
                "max_model_len": max_model_len,
                "resolved": resolved,
                "step_shapes": shapes,
                "compile_s": llm.engine.compile_seconds,
                "cache_stats": llm.stats(),
            }
        )
        for batch in args.batch_sizes:
            result = bench_batch(llm, model, batch, args.prompt_len, args.max_tokens, args.repeats)
            add_floor(result, floor_s)
            result["max_model_len"] = f"{resolved}" + (" (default)" if max_model_len == "default" else "")
            print(
                f"max_model_len {resolved}, batch {batch}: jaxengine / transformers = {result['throughput_ratio']:.2f}x"
            )
            results.append(result)
        retention = llm.stats()["prefix_cache_retention_interval"]
        del llm

    return {
        "machine": machine_info(args.threads, load_start),
        "model": {
            "dir": str(args.model) if args.model else f"random {ARCHS[args.arch][0].__name__} (built by this script)",
            "config": model_summary(model.config),
            "num_parameters": num_params,
            "parameter_bytes": param_bytes,
        },
        "settings": {
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "page_size": 16,
            "dtype": "float32",
            "prefix_caching": not args.no_prefix_caching,
            "prefix_cache_retention_interval": retention,
        },
        "memory_bandwidth_bytes_per_s": bandwidth,
        "decode_floor_s": floor_s,
        "jaxengine_compiles": compiles,
        "results": results,
    }


RETENTIONS = {"dense": None, "sparse": 0}


def main() -> None:
    args = parse_args()
    if args.retention not in ("auto", *RETENTIONS):
        args.retention = int(args.retention)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")
    limit_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = Path(tmp) / args.arch
            build_random_model(model_dir, args.arch)
        report = run(args, model_dir)
    print(format_table(report["results"]))
    load = report["machine"]["load_average_start"], report["machine"]["load_average_end"]
    print(f"1-minute load average: {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end ({os.cpu_count()} CPUs)")
    print(f"CPU malloc settings (JAXENGINE_MALLOC_TUNING=1): {'on' if jaxengine.MALLOC_TUNED else 'off'}")
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
