"""`jaxengine run CONFIG.yaml` end to end, and the config errors reported before any work."""

import json
from pathlib import Path

import pytest
import yaml

from jaxengine.cli import main
from jaxengine.run_config import ConfigError, load_requests, load_run_config

REPO = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, config: dict, lines: list[dict] | None = None) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    if lines is not None:
        prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    base = {
        "model": "default",
        "engine": {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32, "warm_up": False},
        "sampling": {"max_tokens": 4, "temperature": 0.0},
        "input": str(prompts),
        "output": str(tmp_path / "out" / "outputs.jsonl"),
        "metrics": str(tmp_path / "out" / "metrics.json"),
        "progress": False,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**base, **config}))
    return path


LINES = [
    {"id": "a", "prompt": "def add(a, b):\n"},
    {"id": "b", "prompt": "import os\n", "max_tokens": 6, "stop": ["\n\n"]},
    {"prompt_token_ids": [5, 6, 7], "temperature": 0.8, "seed": 3, "cache_salt": "x", "n": 2},
]


def test_run_writes_outputs_and_metrics(tmp_path, capsys):
    main(["run", str(_write(tmp_path, {}, LINES))])
    records = [json.loads(line) for line in (tmp_path / "out" / "outputs.jsonl").read_text().splitlines()]
    assert [(r["id"], r["sample"]) for r in records] == [("a", 0), ("b", 0), ("3", 0), ("3", 1)]
    assert len(records[0]["token_ids"]) == 4 and records[0]["finish_reason"] == "length"
    assert 1 <= len(records[1]["token_ids"]) <= 6 and "\n\n" not in records[1]["text"]
    assert records[2]["num_prompt_tokens"] == records[3]["num_prompt_tokens"] == 3
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["requests"] == 3
    assert metrics["output_tokens"] == sum(len(r["token_ids"]) for r in records)
    for key in ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "compile_s", "cache"):
        assert key in metrics
    assert metrics["cache"]["prefix_cache_retention_interval"] is None  # resolved: dense for the hybrid
    assert "3 requests" in capsys.readouterr().out
    assert records[1]["stop_reason"] in ("\n\n", None)


@pytest.mark.parametrize("value, want", [(None, None), (0, 0), (32, 32), ("auto", "auto")])
def test_yaml_takes_the_retention_interval(tmp_path, value, want):
    cfg = load_run_config(_write(tmp_path, {"engine": {"prefix_cache_retention_interval": value}}, LINES))
    assert cfg.engine.prefix_cache_retention_interval == want


def test_yaml_takes_vllms_engine_argument_names(tmp_path):
    cfg = load_run_config(
        _write(
            tmp_path,
            {"engine": {"block_size": 8, "enforce_eager": True, "max_model_len": 64, "trust_remote_code": True}},
            LINES,
        )
    )
    assert cfg.engine.page_size == 8 and cfg.engine.warm_up is False and cfg.engine.max_model_len == 64


def test_the_default_config_is_valid(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_run_config("configs/default.yaml")
    assert len(load_requests(cfg)) >= 5


@pytest.mark.parametrize(
    "change,match",
    [
        ({"engin": {}}, r"unknown key 'engin'"),
        ({"engine": {"max_num_seqs": "8"}}, r"engine.max_num_seqs: expected .*int.*got '8'"),
        ({"engine": {"max_num_seq": 8}}, r"engine: unknown key 'max_num_seq'"),
        ({"engine": {"tensor_parallel_size": 0}}, r"engine argument tensor_parallel_size must be a positive integer"),
        ({"engine": {"data_parallel_size": 0}}, r"engine argument data_parallel_size must be a positive integer"),
        ({"engine": {"num_nodes": 2}}, r"distributed_init_addr must be process 0's \"host:port\" when num_nodes=2"),
        ({"engine": {"num_nodes": 2, "distributed_init_addr": "h:99999"}}, r"distributed_init_addr must be"),
        (
            {"engine": {"num_nodes": 2, "distributed_init_addr": "h:1", "node_rank": 2}},
            r"engine argument node_rank must be an integer in \[0, num_nodes=2\), got 2",
        ),
        ({"engine": {"distributed_init_addr": "h:1"}}, r"distributed_init_addr='h:1' needs num_nodes > 1"),
        (
            {"engine": {"num_nodes": 2, "distributed_init_addr": "h:1", "data_parallel_size": 2}},
            r"data_parallel_size=2 is not supported with num_nodes=2",
        ),
        (
            {"engine": {"ssm_retention": "dense"}},
            r"engine: key 'ssm_retention' was replaced by prefix_cache_retention_interval",
        ),
        ({"engine": {"prefix_cache_retention_interval": 6}}, r"prefix_cache_retention_interval must be None"),
        ({"sampling": {"top_p": 1.5}}, r"SamplingParams.top_p must be a finite number in \(0, 1\]"),
        ({"sampling": {"temprature": 0.5}}, r"sampling: unknown key 'temprature'"),
        ({"sampling": {"temperature": float("nan")}}, r"SamplingParams.temperature must be a finite number"),
        ({"sampling": {"seed": 2**64}}, r"SamplingParams.seed must be an integer"),
        ({"model": "/no/such/model"}, r"model: /no/such/model is not a model directory"),
        ({"input": "/no/such/prompts.jsonl"}, r"input: file /no/such/prompts.jsonl does not exist"),
        ({"progress": "yes"}, r"progress must be true or false"),
    ],
)
def test_config_errors_name_the_key(tmp_path, change, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(_write(tmp_path, change, LINES))


@pytest.mark.parametrize(
    "line,match",
    [
        ({"id": "q", "prompt": "x", "max_token": 3}, r"prompts.jsonl:1: unknown key 'max_token'"),
        ({"id": "q"}, r"prompts.jsonl:1: give exactly one of 'prompt' or 'prompt_token_ids'"),
        ({"id": "q", "prompt": "x", "temperature": "hot"}, r"prompts.jsonl:1.temperature: expected"),
        ({"id": "q", "prompt": "x", "repetition_penalty": float("nan")}, r"repetition_penalty must be a finite"),
    ],
)
def test_bad_input_lines_name_the_line_and_key(tmp_path, line, match):
    cfg = load_run_config(_write(tmp_path, {}, [line]))
    with pytest.raises(ConfigError, match=match):
        load_requests(cfg)


def test_host_flags_set_the_engine_keys_and_other_hosts_read_no_input(tmp_path):
    hosts = {"distributed_init_addr": "10.0.0.1:8476", "num_nodes": 2, "node_rank": 1}
    cfg = load_run_config(_write(tmp_path, {"input": "/only/on/host0.jsonl"}), hosts)
    assert (cfg.engine.distributed_init_addr, cfg.engine.num_nodes, cfg.engine.node_rank) == ("10.0.0.1:8476", 2, 1)
    with pytest.raises(ConfigError, match="input: file /only/on/host0.jsonl does not exist"):
        load_run_config(_write(tmp_path, {"input": "/only/on/host0.jsonl"}), {**hosts, "node_rank": 0})


def test_cli_reports_config_errors_in_one_line(tmp_path):
    with pytest.raises(SystemExit, match=r"jaxengine: error: .*unknown key 'bogus'"):
        main(["run", str(_write(tmp_path, {"bogus": 1}, LINES))])


def test_unwritable_outputs_are_refused_before_the_model_loads(tmp_path, monkeypatch):
    from jaxengine import batch_run

    monkeypatch.setattr(batch_run, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    (tmp_path / "dir_out").mkdir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for output in (tmp_path / "dir_out", blocker / "sub" / "outputs.jsonl"):
        cfg = load_run_config(_write(tmp_path, {"output": str(output)}, LINES))
        with pytest.raises(ConfigError, match=str(output)):
            batch_run.run_batch(cfg)


def test_outputs_and_metrics_are_replaced_together_or_not_at_all(tmp_path, monkeypatch):
    from jaxengine import batch_run

    out, metrics = tmp_path / "o.jsonl", tmp_path / "m.json"
    out.write_text("old outputs")
    metrics.write_text("old metrics")
    real = batch_run.os.replace
    calls = []

    def failing(src, dst):
        calls.append(dst)
        if str(dst) == str(metrics) and len(calls) == 4:  # the new metrics, after the new outputs
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(batch_run.os, "replace", failing)
    with pytest.raises(OSError, match="disk full"):
        batch_run.write_together({out: "new outputs", metrics: "new metrics"})
    assert out.read_text() == "old outputs" and metrics.read_text() == "old metrics"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "o.jsonl"]  # no leftovers
    monkeypatch.setattr(batch_run.os, "replace", real)
    batch_run.write_together({out: "new outputs", metrics: "new metrics"})
    assert out.read_text() == "new outputs" and metrics.read_text() == "new metrics"


def test_a_broken_model_file_is_one_line(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_bytes((REPO / "jaxengine" / "assets" / "default_model" / name).read_bytes())
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(SystemExit, match=r"jaxengine: error: .*model.safetensors: cannot read the safetensors file"):
        main(["run", str(_write(tmp_path, {"model": str(model)}, LINES))])
