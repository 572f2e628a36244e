"""`jaxengine run CONFIG.yaml`: a whole batch job from a validated config."""

import json
import os
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxengine.engine.llm import LLM
from jaxengine.engine.outputs import CompletionOutput, RequestOutput
from jaxengine.run_config import ConfigError, RunConfig, load_requests


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def check_writable(*paths: Path) -> None:
    """Raises ConfigError unless each path can be written (its directory made if need be),
    before a job spends any time."""
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"{path}: is a directory, not an output file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=True)
            probe.close()
        except OSError as err:
            raise ConfigError(f"{path}: cannot be written ({err.strerror or err})") from None


def write_together(contents: dict[Path, str]) -> None:
    """Writes the files so that a failure leaves all of them new or all of them as they were
    (never new outputs next to stale metrics): each is written to a temporary file beside it,
    the old ones are moved aside, the new ones renamed into place; on any error the old ones
    come back."""
    temporaries: dict[Path, str] = {}
    moved_aside: dict[Path, str] = {}
    placed: list[Path] = []
    try:
        for path, text in contents.items():
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            temporaries[path] = tmp
        for path in contents:
            if path.exists():
                aside = str(path.with_name(f".{path.name}.old.{os.getpid()}"))
                os.replace(path, aside)
                moved_aside[path] = aside
        for path, tmp in temporaries.items():
            os.replace(tmp, path)
            placed.append(path)
    except BaseException:
        for path in placed:
            if path not in moved_aside:
                os.unlink(path)
        for path, aside in moved_aside.items():
            os.replace(aside, path)
        moved_aside.clear()
        raise
    finally:
        for leftover in [*temporaries.values(), *moved_aside.values()]:
            if os.path.exists(leftover):
                os.unlink(leftover)


def run_batch(cfg: RunConfig) -> dict:
    """Runs every request of the config's input, writes outputs and metrics; returns the metrics.
    On a process other than 0 of several: runs process 0's steps, writes nothing, and returns
    {"steps_followed": how many}."""
    engine_args = {k: v for k, v in vars(cfg.engine).items() if k not in ("dtype", "warm_up")}
    if cfg.engine.node_rank > 0:
        llm = LLM(cfg.model, cfg.engine.dtype, warm_up=False, **engine_args)
        if cfg.engine.warm_up:
            llm.warm_up(progress=cfg.progress)
        return {"steps_followed": llm.follow()}
    check_writable(cfg.output, cfg.metrics)
    requests = load_requests(cfg)
    start = time.perf_counter()
    llm = LLM(cfg.model, cfg.engine.dtype, warm_up=False, **engine_args)
    try:  # every request is checked (and tokenized, once) before anything compiles
        token_ids = [
            llm.engine.validate_request(r.prompt, r.params, f"request {r.id!r} (line {i + 1})")
            for i, r in enumerate(requests)
        ]
    except ValueError as err:
        raise ConfigError(f"{cfg.input}: {err}") from err
    if cfg.engine.warm_up:
        llm.warm_up(progress=cfg.progress)
    load_and_compile = time.perf_counter() - start
    start = time.perf_counter()
    prompts = [{"prompt_token_ids": ids, "cache_salt": r.cache_salt} for ids, r in zip(token_ids, requests)]
    outputs = llm.generate(prompts, [r.params for r in requests], use_tqdm=cfg.progress)
    wall = time.perf_counter() - start

    records = "".join(
        json.dumps(_output_record(r.id, out, c)) + "\n" for r, out in zip(requests, outputs) for c in out.outputs
    )
    metrics = _metrics(cfg, llm, outputs, wall, load_and_compile)
    write_together({cfg.output: records, cfg.metrics: json.dumps(metrics, indent=2) + "\n"})
    return metrics


def _output_record(request_id: str, out: RequestOutput, sample: CompletionOutput) -> dict:
    """One line of the outputs file: one sample of one request (`sample` counts them when n > 1)."""
    record = {
        "id": request_id,
        "sample": sample.index,
        "text": sample.text,
        "token_ids": sample.token_ids,
        "finish_reason": sample.finish_reason,
        "stop_reason": sample.stop_reason,
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "time_to_first_token_s": sample.time_to_first_token,
        "time_per_output_token_s": sample.time_per_output_token,
    }
    if sample.logprobs is not None:
        record["logprobs"] = [{str(k): v.logprob for k, v in step.items()} for step in sample.logprobs]
        record["cumulative_logprob"] = sample.cumulative_logprob
    return record


def _metrics(cfg: RunConfig, llm: LLM, outputs: list[RequestOutput], wall: float, load_and_compile: float) -> dict:
    engine = llm.engine
    samples = [c for o in outputs for c in o.outputs]
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for c in samples)
    ttfts = [c.time_to_first_token for c in samples if c.time_to_first_token is not None]
    tpots = [c.time_per_output_token for c in samples if c.time_per_output_token is not None]
    return {
        "model": str(cfg.model),
        "device": str(jax.devices()[0].device_kind),
        "requests": len(outputs),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "wall_time_s": wall,
        "output_tokens_per_s": output_tokens / wall if wall else None,
        "total_tokens_per_s": (input_tokens + output_tokens) / wall if wall else None,
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_p99_s": _percentile(ttfts, 99),
        "tpot_p50_s": _percentile(tpots, 50),
        "load_and_compile_s": load_and_compile,
        "compile_s": engine.compile_seconds,
        "num_compiled_shapes": len(engine.shapes()),
        "cache": engine.stats(),
        "finish_reasons": {r: sum(c.finish_reason == r for c in samples) for r in ("stop", "length")},
    }
