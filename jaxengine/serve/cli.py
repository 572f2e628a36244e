"""`jaxengine serve MODEL`: vLLM's `vllm serve` flags where they mean the same, and every
engine argument as its kebab-case flag (`--max-num-seqs 32`, `--no-enable-prefix-caching`).
Flags a user does not give leave the `--config` file's `engine:` section, then the engine's
defaults, in force. An unknown flag is an error naming it."""

import argparse
import dataclasses
import json
import logging
import os
import signal
import types
import typing

from jaxengine.engine import vllm_args
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.run_config import DEFAULT_MODEL, ConfigError, load_engine_section

logger = logging.getLogger("jaxengine")

# The value type of each of vLLM's engine arguments that jaxengine takes under other names or
# ignores (`vllm_args.known_names()`, the list of them).
VLLM_FLAG_TYPES = {
    "block_size": int,
    "enforce_eager": bool,
    "trust_remote_code": bool,
    "disable_log_stats": bool,
    "enable_chunked_prefill": bool,
    "swap_space": float,
    "max_seq_len_to_capture": int,
    "disable_custom_all_reduce": bool,
    "tokenizer_mode": str,
    "pipeline_parallel_size": int,
    "kv_cache_dtype": str,
    "quantization": str,
    "revision": str,
    "tokenizer_revision": str,
    "enable_lora": bool,
    "max_num_partial_prefills": int,
}


def _flag_type(annotation):
    """(argparse type, is a bool flag) of an engine field's annotation."""
    args = (
        [a for a in typing.get_args(annotation) if a is not type(None)]
        if isinstance(annotation, types.UnionType)
        else [annotation]
    )
    if bool in args:
        return None, True
    if dict in args:
        return json.loads, False
    if int in args and str in args:  # prefix_cache_retention_interval: a number, "auto" or "none"
        return _int_or_word, False
    for kind in (int, float, str):
        if kind in args:
            return kind, False
    return str, False


def _int_or_word(value: str):
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        return value


def add_parser(sub) -> None:
    """The `serve` subcommand's parser."""
    p = sub.add_parser("serve", help="serve a model over OpenAI's HTTP API", description=__doc__)
    p.add_argument("model", nargs="?", help="a model directory, or 'default' for the embedded model")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model's name in requests and /v1/models (default: MODEL)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("JAXENGINE_API_KEY"),
        help="bearer token /v1 requests must carry ($JAXENGINE_API_KEY)",
    )
    p.add_argument("--chat-template", help="a Jinja chat template, or a file holding one (default: the tokenizer's)")
    p.add_argument(
        "--config", help="a YAML file whose model and engine: section (as for `jaxengine run`) apply under the flags"
    )
    p.add_argument("--uvicorn-log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    engine = p.add_argument_group("engine arguments (EngineConfig; see docs/engine-arguments.md)")
    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        kind, is_bool = _flag_type(hints[field.name])
        _add_engine_flag(engine, field.name, kind, is_bool)
    vllm = p.add_argument_group("vLLM's engine flags (translated or without effect here)")
    for name in vllm_args.known_names():
        kind = VLLM_FLAG_TYPES[name]
        _add_engine_flag(vllm, name, kind, kind is bool)
    p.set_defaults(func=serve)


def _add_engine_flag(group, name: str, kind, is_bool: bool) -> None:
    flag = "--" + name.replace("_", "-")
    if is_bool:
        group.add_argument(
            flag, dest=f"engine.{name}", action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS
        )
    else:
        group.add_argument(flag, dest=f"engine.{name}", type=kind, default=argparse.SUPPRESS, metavar=name.upper())


def engine_arguments(args: argparse.Namespace) -> tuple[str, dict]:
    """The model and engine arguments: the flags over the --config file's."""
    model, engine = None, {}
    if args.config:
        model, engine = load_engine_section(args.config)
    flags = {k.removeprefix("engine."): v for k, v in vars(args).items() if k.startswith("engine.")}
    model = args.model or model
    if model is None:
        raise ConfigError("serve: give a MODEL (a model directory or 'default'), or a --config with model:")
    return model, {**engine, **flags}


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    from jaxengine import LLM
    from jaxengine.engine.engine_loop import EngineLoop
    from jaxengine.serve.app import ServerState, build_app
    from jaxengine.serve.metrics import ServerMetrics
    from jaxengine.serve.sampling import read_template

    model, engine_args = engine_arguments(args)
    name = args.served_model_name or model
    llm = LLM(DEFAULT_MODEL if model == "default" else model, **engine_args)
    loop = EngineLoop(llm).start()
    state = ServerState(loop, name, read_template(args.chat_template), args.api_key, ServerMetrics(loop, name))
    app = build_app(state)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=30
    )
    server = uvicorn.Server(config)
    logger.info("serving %s as %r on http://%s:%d/v1", model, name, args.host, args.port)
    # uvicorn handles SIGINT and SIGTERM while it serves (it stops taking requests and lets
    # those in flight finish), then raises the signal again for the handler it found: these
    # ones, so that the engine is shut down and the process exits 0. The handlers before are
    # put back after (a caller that serves in-process keeps its own Ctrl-C).
    previous = {sig: signal.signal(sig, lambda signum, frame: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run()
    finally:
        loop.stop(timeout=30)
        llm.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
