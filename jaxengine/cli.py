"""Command line: `jaxengine run`, `jaxengine serve`, `jaxengine generate` and `jaxengine convert`."""

import argparse
import logging
import shutil
import sys
import time
from pathlib import Path

from jaxengine.run_config import DEFAULT_MODEL
from jaxengine.serve import cli as serve_cli

# `jaxengine run` flags that set the engine keys of the same names (one host's settings).
HOST_ARGS = ("distributed_init_addr", "num_nodes", "node_rank")

# Files copied beside the converted parameters so the output directory is a complete model.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _run(args: argparse.Namespace) -> None:
    from jaxengine.batch_run import run_batch
    from jaxengine.run_config import load_run_config

    hosts = {key: getattr(args, key) for key in HOST_ARGS if getattr(args, key) is not None}
    cfg = load_run_config(args.config, hosts)
    metrics = run_batch(cfg)
    if cfg.engine.node_rank > 0:
        print(f"node {cfg.engine.node_rank}: ran process 0's {metrics['steps_followed']} steps")
        return
    print(
        f"{metrics['requests']} requests, {metrics['output_tokens']} output tokens in {metrics['wall_time_s']:.1f}s "
        f"({metrics['output_tokens_per_s']:.1f} tok/s); outputs: {cfg.output}; metrics: {cfg.metrics}"
    )


def _generate(args: argparse.Namespace) -> None:
    from jaxengine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, warm_up=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        completion = out.outputs[0]
        print(f"--- {out.prompt!r} ({len(completion.token_ids)} tokens, {completion.finish_reason})")
        print(out.prompt + completion.text)


def _convert(args: argparse.Namespace) -> None:
    from jaxengine.models.arch import load_model_config
    from jaxengine.models.loader import load_model
    from jaxengine.models.param_store import save_params

    src, out = Path(args.hf_dir), Path(args.out_dir)
    start = time.perf_counter()
    _, _, state = load_model(src, args.dtype, mtp=bool(load_model_config(src).mtp_layers))  # the MTP module too
    out.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, out / name)
    save_params(state, out)
    print(f"converted {src} -> {out} ({args.dtype}) in {time.perf_counter() - start:.1f}s")


def _show_engine_log() -> None:
    """Start-up facts (such as the prefix cache's retention) as `jaxengine: ...` lines on stderr."""
    logger = logging.getLogger("jaxengine")
    if not logger.handlers:
        logger.propagate = False  # not twice where something configured the root logger (jax.distributed)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("jaxengine: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `jaxengine` command."""
    parser = argparse.ArgumentParser(prog="jaxengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a batch job described by a YAML config")
    run.add_argument("config", help="YAML config (see configs/default.yaml)")
    run.add_argument(
        "--distributed-init-addr",
        dest="distributed_init_addr",
        help="many hosts: process 0's host:port (over the config's engine key)",
    )
    run.add_argument("--num-nodes", dest="num_nodes", type=int, help="many hosts: how many processes")
    run.add_argument(
        "--node-rank",
        dest="node_rank",
        type=int,
        help="many hosts: this process's rank (0 takes the requests and writes the outputs)",
    )
    run.set_defaults(func=_run)

    serve_cli.add_parser(sub)

    gen = sub.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("prompts", nargs="+", help="text prompts")
    gen.add_argument("--model", default=str(DEFAULT_MODEL), help="model directory (default: the embedded model)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)

    conv = sub.add_parser("convert", help="store a Hugging Face checkpoint's parameters with Orbax")
    conv.add_argument("hf_dir")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    conv.set_defaults(func=_convert)

    args = parser.parse_args(argv)
    _show_engine_log()
    try:
        args.func(args)
    except KeyboardInterrupt:
        sys.exit("jaxengine: interrupted")
    except (ValueError, OSError) as err:  # bad input, unreadable or unwritable files
        sys.exit(f"jaxengine: error: {err}")
    except Exception as err:  # anything else, still one line
        sys.exit(f"jaxengine: error: {type(err).__name__}: {err}")


if __name__ == "__main__":
    main()
