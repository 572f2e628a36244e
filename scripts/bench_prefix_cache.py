"""Prefix caching on vs off, side by side, on a hybrid and a plain-transformer model.

    python scripts/bench_prefix_cache.py [--json bench_prefix_cache.json] [--questions 64]
        [--workloads system-prompt,short-prefix,conversations,agentic] [--cache-mib 8 24]

Workloads (token-id prompts, greedy, the same for every configuration):
  system-prompt   a 1984-token shared system prompt followed by distinct 32-token questions,
                  all submitted at once; reports mean/p50 TTFT, output tokens/s, hit rate;
  conversations   8 conversations x 6 turns, interleaved, each turn's prompt the previous
                  prompt + answer + a new message, one request at a time, both models with
                  the same cache pool bytes (`--cache-mib`, KV pages and checkpoints
                  together); reports hit rate and the bytes pages and checkpoints hold, per
                  retention interval (dense is the default);
  short-prefix    a 200-token shared prefix (shorter than any large block): must hit;
  agentic         interleaved agent sessions over a shared tool specification, one request at
                  a time on the hybrid, each turn's prompt the last one's, the engine's own
                  answer and a tool result; the same requests (with the answers the engine
                  gave) are then replayed through `replay_prefix_trace.py` at the engine's
                  pool size: the engine's `hit_rate` and `tokens_lost_for_want_of_checkpoint`
                  must follow the replay's.
The hybrid model is the embedded default (Bamba); the plain transformer is a Llama of the
same width and depth with random weights (speed and hit rates do not depend on the weights).
"""

import argparse
import contextlib
import io
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from transformers import LlamaConfig, LlamaForCausalLM

from jaxengine import LLM, SamplingParams
from jaxengine.models.arch import load_model_config
from jaxengine.run_config import DEFAULT_MODEL

sys.path.insert(0, str(Path(__file__).parent))
import make_prefix_trace  # noqa: E402
import replay_prefix_trace  # noqa: E402

ENGINE = dict(max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=512, page_size=16)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, vocab, size=n).tolist()


def _llama_like(hybrid_dir: Path, out: Path) -> Path:
    """A random Llama with the hybrid model's width, depth, heads and vocabulary."""
    cfg = load_model_config(hybrid_dir)
    a = cfg.attention
    llama = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.mlp.intermediate_size,
        num_hidden_layers=len(cfg.layers),
        num_attention_heads=a.num_heads,
        num_key_value_heads=a.num_kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(llama).save_pretrained(out)
    return out


def _system_prompt(model: Path, caching: bool, questions: int) -> dict:
    llm = LLM(model, enable_prefix_caching=caching, compilation_cache_dir=None, **ENGINE)
    vocab = llm.engine.model_config.vocab_size
    system = _tokens(1984, 0, vocab)  # with a question and the answer, within the model's 2048 positions
    prompts = [system + _tokens(32, 1 + i, vocab) for i in range(questions)]
    start = time.perf_counter()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    wall = time.perf_counter() - start
    ttft = [o.time_to_first_token for o in outs]
    stats = llm.stats()
    return {
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p50_s": float(np.median(ttft)),
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "wall_s": wall,
        "hit_rate": stats["hit_rate"],
        "cached_tokens_per_request": [o.num_cached_tokens for o in outs[:4]],
    }


RETENTIONS = {"dense": None, "sparse": 0, "every=128": 128}


def _conversations(model: Path, retention: int | None, cache_bytes: int) -> dict:
    llm = LLM(
        model,
        prefix_cache_retention_interval=retention,
        kv_cache_memory_bytes=cache_bytes,
        compilation_cache_dir=None,
        **{**ENGINE, "warm_up": False},
    )  # one request at a time: few shapes
    vocab = llm.engine.model_config.vocab_size
    system = _tokens(300, 99, vocab)
    convs = [system + _tokens(120, 1000 + c, vocab) for c in range(8)]
    for turn in range(6):
        for c in range(8):  # interleaved: one turn of each conversation in turn
            out = llm.generate([convs[c]], GREEDY, use_tqdm=False)[0]
            convs[c] = convs[c] + out.outputs[0].token_ids + _tokens(40, 10_000 + 8 * turn + c, vocab)
    stats = llm.stats()
    keys = (
        "hit_rate",
        "tokens_lost_for_want_of_checkpoint",
        "kv_page_bytes_held",
        "checkpoint_bytes_held",
        "checkpoints_held",
        "kv_page_evictions",
        "checkpoint_evictions",
        "checkpoints_written",
        "checkpoints_skipped",
        "cache_blocks",
        "cache_block_bytes",
    )
    return {k: stats[k] for k in keys}


def _agentic(model: Path, cache_bytes: int, out: Path) -> dict:
    llm = LLM(model, kv_cache_memory_bytes=cache_bytes, compilation_cache_dir=None, **{**ENGINE, "warm_up": False})
    vocab = llm.engine.model_config.vocab_size
    plan = make_prefix_trace.agentic(
        make_prefix_trace.TokenSource(0, vocab),
        num_sessions=16,
        turns=(3, 6),
        tool_spec_tokens=600,
        task_tokens=(20, 80),
        tool_result_tokens=(40, 200),
        action_tokens=(8, 24),
        max_active=8,
    )
    history: dict[int, tuple[int, list[int]]] = {}  # session -> (the plan's history length, the real one)
    realized = []
    for r in plan:
        planned, real = history.get(r.session_id, (0, []))
        prompt = real + r.input_tokens[planned:]  # the plan's new tokens after the engine's answers
        params = SamplingParams(max_tokens=len(r.output_tokens), temperature=0.0, ignore_eos=True)
        answer = list(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
        realized.append(make_prefix_trace.Request(r.session_id, r.turn_id, prompt, answer))
        history[r.session_id] = (len(r.input_tokens) + len(r.output_tokens), prompt + answer)
    stats = llm.stats()
    make_prefix_trace.write_trace(realized, out)
    with contextlib.redirect_stdout(io.StringIO()):  # the engine's pool, its block count and size
        replay = replay_prefix_trace.main(
            [
                str(out),
                "--model-config",
                str(model),
                "--budget-bytes",
                "0",
                "--pool-blocks",
                str(stats["cache_blocks"] + 1),
            ]
        )
    if replay["budget"]["block_bytes"] != stats["cache_block_bytes"]:
        raise RuntimeError("the replay's block size differs from the engine's: compare like with like")
    return {
        "requests": len(realized),
        "engine_hit_rate": stats["hit_rate"],
        "replay_hit_rate": replay["token_hit_rate"],
        "engine_tokens_lost": stats["tokens_lost_for_want_of_checkpoint"],
        "replay_tokens_lost": replay["lost_tokens"],
        "cache_blocks": stats["cache_blocks"],
    }


def _short_prefix(model: Path) -> list[int]:
    llm = LLM(model, compilation_cache_dir=None, **ENGINE)
    vocab = llm.engine.model_config.vocab_size
    prefix = _tokens(200, 5, vocab)
    return [
        llm.generate([prefix + _tokens(10, 50 + i, vocab)], GREEDY, use_tqdm=False)[0].num_cached_tokens
        for i in range(4)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="bench_prefix_cache.json")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument(
        "--cache-mib", type=float, nargs="+", default=[8, 24], help="cache pool sizes for the conversations workload"
    )
    parser.add_argument("--workloads", default="system-prompt,short-prefix,conversations,agentic")
    args = parser.parse_args()
    workloads = set(args.workloads.split(","))

    results: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"processor": platform.processor() or platform.machine(), "device": jax.devices()[0].device_kind},
        "engine": ENGINE,
    }
    with tempfile.TemporaryDirectory() as tmp:
        models = {
            "hybrid (Bamba)": DEFAULT_MODEL,
            "transformer (Llama)": _llama_like(DEFAULT_MODEL, Path(tmp) / "llama"),
        }
        for name, path in models.items():
            if "system-prompt" not in workloads:
                break
            off = _system_prompt(path, False, args.questions)
            on = _system_prompt(path, True, args.questions)
            results[f"system_prompt/{name}"] = {
                "off": off,
                "on": on,
                "ttft_ratio": off["ttft_mean_s"] / on["ttft_mean_s"],
                "throughput_ratio": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            }
            print(f"{name}: shared 1984-token system prompt, {args.questions} questions")
            print(
                f"  TTFT mean off {off['ttft_mean_s']:.3f}s  on {on['ttft_mean_s']:.3f}s  ratio {off['ttft_mean_s'] / on['ttft_mean_s']:.1f}x"
            )
            print(f"  output tok/s off {off['output_tokens_per_s']:.1f}  on {on['output_tokens_per_s']:.1f}")
        for name, path in models.items():
            if "short-prefix" in workloads:
                results[f"short_prefix/{name}"] = _short_prefix(path)
                print(f"{name}: 200-token shared prefix, cached tokens per request: {results[f'short_prefix/{name}']}")
        for mib in args.cache_mib if "conversations" in workloads else ():
            for retention, interval in RETENTIONS.items():
                for name, path in models.items():
                    if retention != "dense" and "Llama" in name:
                        continue  # retention only concerns recurrent-state checkpoints
                    row = _conversations(path, interval, int(mib * 2**20))
                    results[f"conversations/{mib:g}MiB/{retention}/{name}"] = row
                    print(
                        f"conversations {mib:g} MiB {retention:<10} {name:<20} hit rate {row['hit_rate']:.3f}  "
                        f"pages {row['kv_page_bytes_held'] / 2**20:.1f} MiB, checkpoints "
                        f"{row['checkpoint_bytes_held'] / 2**20:.1f} MiB ({row['checkpoints_held']})",
                        flush=True,
                    )
        for mib in args.cache_mib if "agentic" in workloads else ():
            row = _agentic(DEFAULT_MODEL, int(mib * 2**20), Path(tmp) / f"agentic-{mib:g}.jsonl")
            results[f"agentic/{mib:g}MiB"] = row
            print(
                f"agentic {mib:g} MiB, {row['requests']} requests: hit rate engine {row['engine_hit_rate']:.3f} "
                f"replay {row['replay_hit_rate']:.3f}; lost for want of a checkpoint engine "
                f"{row['engine_tokens_lost']} replay {row['replay_tokens_lost']} tokens",
                flush=True,
            )
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
