"""The YAML config of a batch run, validated completely before anything is loaded or compiled.

```yaml
model: default                 # "default" (the embedded model) or a model directory
engine: {max_num_seqs: 16}     # EngineConfig fields
sampling: {max_tokens: 64}     # default SamplingParams for every request
input: prompts.jsonl           # per line: {"id", "prompt" | "prompt_token_ids", "cache_salt", sampling overrides}
output: outputs.jsonl          # one result per line, in input order
metrics: metrics.json          # throughput, latency percentiles, compile time, pool use
progress: true
```
Relative paths are taken from the directory the command runs in.
"""

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from jaxengine.engine import vllm_args
from jaxengine.engine.engine_config import EngineConfig, check_engine_keys
from jaxengine.engine.sampling_params import SamplingParams

DEFAULT_MODEL = Path(__file__).parent / "assets" / "default_model"
REQUEST_KEYS = ("id", "prompt", "prompt_token_ids", "cache_salt")


@dataclasses.dataclass(frozen=True)
class RunRequest:
    """One line of the input file."""

    id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A validated batch-run config."""

    source: Path
    model: Path
    engine: EngineConfig
    sampling: SamplingParams
    input: Path
    output: Path
    metrics: Path
    progress: bool


class ConfigError(ValueError):
    """A config problem, reported as one line naming the key or path."""


def _accepts(annotation: Any, value: Any) -> bool:
    """Whether `value` fits a simple annotation (int, float, str, bool, None, unions, tuples)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(a, value) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is tuple:
        item = typing.get_args(annotation)[0]
        return isinstance(value, (list, tuple)) and all(_accepts(item, v) for v in value)
    return True


def _typed(cls: type, values: Any, where: str) -> Any:
    """Builds dataclass `cls` from a mapping, naming unknown keys and wrongly typed values."""
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown key {key!r}; known: {', '.join(hints)}")
        if not _accepts(hints[key], value):
            raise ConfigError(f"{where}.{key}: expected {hints[key]}, got {value!r} ({type(value).__name__})")
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:  # a nested mapping with an unknown key, too
        raise ConfigError(f"{where}: {err}") from err


def _read_mapping(path: Path) -> dict:
    """A YAML config file's top-level mapping; a ConfigError naming the file otherwise."""
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping of keys")
    return raw


def load_run_config(path: str | Path, engine_overrides: dict | None = None) -> RunConfig:
    """Reads and validates a run config; every problem is a ConfigError naming the key.
    `engine_overrides`: engine keys given on the command line (a host's node_rank), over the
    file's. A process other than 0 of several reads no input (process 0 takes the requests)."""
    path = Path(path)
    raw = _read_mapping(path)
    known = ("model", "engine", "sampling", "input", "output", "metrics", "progress")
    for key in raw:
        if key not in known:
            raise ConfigError(f"{path}: unknown key {key!r}; known: {', '.join(known)}")
    for key in ("model", "input", "output", "metrics"):
        if key not in raw:
            raise ConfigError(f"{path}: missing key {key!r}")
        if not isinstance(raw[key], str):
            raise ConfigError(f"{path}: {key} must be a string path, got {raw[key]!r}")
    model = DEFAULT_MODEL if raw["model"] == "default" else Path(raw["model"])
    if not (model / "config.json").is_file():
        raise ConfigError(f"{path}: model: {model} is not a model directory (no config.json)")
    input_path = Path(raw["input"])
    engine_raw = raw.get("engine")
    if engine_overrides:
        engine_raw = {**(engine_raw if isinstance(engine_raw, dict) else {}), **engine_overrides}
    try:
        if isinstance(engine_raw, dict):  # vLLM's names too
            engine_raw = vllm_args.translate(engine_raw)
        check_engine_keys(engine_raw or {}, "key")
    except ValueError as err:
        raise ConfigError(f"{path}: engine: {err}") from err
    engine = _typed(EngineConfig, engine_raw, f"{path}: engine")
    try:
        engine.validate()
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from err
    if engine.node_rank == 0 and not input_path.is_file():
        raise ConfigError(f"{path}: input: file {input_path} does not exist")
    sampling = _typed(SamplingParams, raw.get("sampling"), f"{path}: sampling")
    try:
        sampling.validate(f"{path}: sampling", max_logprobs=engine.max_logprobs)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    progress = raw.get("progress", True)
    if not isinstance(progress, bool):
        raise ConfigError(f"{path}: progress must be true or false, got {progress!r}")
    return RunConfig(path, model, engine, sampling, input_path, Path(raw["output"]), Path(raw["metrics"]), progress)


def load_engine_section(path: str | Path) -> tuple[str | None, dict]:
    """A config's `model` and `engine:` section alone (what `jaxengine serve --config` reads);
    the engine keys are checked by name here and by value when the engine is built."""
    path = Path(path)
    raw = _read_mapping(path)
    model, engine = raw.get("model"), raw.get("engine") or {}
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"{path}: model must be a string path, got {model!r}")
    if not isinstance(engine, dict):
        raise ConfigError(f"{path}: engine must be a mapping of engine arguments")
    try:
        check_engine_keys(vllm_args.translate(engine), "key")
    except ValueError as err:
        raise ConfigError(f"{path}: engine: {err}") from err
    return model, engine


def load_requests(cfg: RunConfig) -> list[RunRequest]:
    """Parses the input JSONL; a bad line is a ConfigError naming the file, line and key."""
    requests = []
    for number, line in enumerate(cfg.input.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{cfg.input}:{number}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: not valid JSON: {err}") from err
        if not isinstance(item, dict):
            raise ConfigError(f"{where}: each line must be a JSON object")
        if ("prompt" in item) == ("prompt_token_ids" in item):
            raise ConfigError(f"{where}: give exactly one of 'prompt' or 'prompt_token_ids'")
        prompt = item.get("prompt", item.get("prompt_token_ids"))
        overrides = {k: v for k, v in item.items() if k not in REQUEST_KEYS}
        params = _typed(SamplingParams, {**dataclasses.asdict(cfg.sampling), **overrides}, where)
        try:
            params.validate(where, max_logprobs=cfg.engine.max_logprobs)
        except ValueError as err:
            raise ConfigError(str(err)) from err
        salt = item.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ConfigError(f"{where}: cache_salt must be a string, got {salt!r}")
        requests.append(RunRequest(str(item.get("id", number)), prompt, params, salt))
    if not requests:
        raise ConfigError(f"{cfg.input}: no requests")
    return requests
