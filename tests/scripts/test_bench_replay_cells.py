"""The cell-by-cell replay comparison: the cells of the tables, and each version's replay read back."""

import json
from pathlib import Path

import pytest

from jaxengine.run_config import DEFAULT_MODEL
from tests.scripts.load_script import load_script

bench = load_script("bench_replay_cells")
replay = load_script("replay_prefix_trace")


def test_the_cells_are_those_of_the_tables(tmp_path: Path, monkeypatch):
    """74 in the main table (24 synthetic, 50 Mooncake), 35 held out, 20 in other projects' shapes."""
    monkeypatch.setattr(bench, "_write", lambda path, make: path)  # no traces written
    monkeypatch.setattr(bench.make_peer_traces, "main", lambda argv: None)
    mooncake = tmp_path / "mooncake"
    todo = bench.cells(bench.GROUPS, tmp_path, mooncake)
    counts = {g: sum(c.group == g for c in todo) for g in bench.GROUPS}
    assert counts == {"synthetic": 24, "held-out": 35, "peer": 20, "mooncake": 50}
    assert len({c.name for c in todo}) == len(todo)
    conv = next(c for c in todo if c.trace == "Mooncake conv-0/20" and c.gb == 10)
    assert conv.path == mooncake / "conversation_trace.jsonl" and conv.fmt == (
        "--format",
        "mooncake",
        "--replica",
        "0/20",
    )
    with pytest.raises(SystemExit, match="mooncake-dir"):
        bench.cells(["mooncake"], tmp_path, None)


def test_each_version_reports_what_the_replay_in_this_process_does(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    prefix = list(range(1, 41))
    trace.write_text(
        "".join(
            json.dumps({"input_tokens": prefix + [k] * 10, "output_tokens": [7] * 4, "session_id": i}) + "\n"
            for i, k in enumerate((101, 102, 103))
        )
    )
    todo = [bench.Cell("tiny", "tiny", trace, (), gb) for gb in (1e-3, 1.0)]
    config = DEFAULT_MODEL / "config.json"
    settings = ["--model-config", str(config), "--kv-dtype", "bfloat16", "--state-dtype", "bfloat16"]
    expected = [
        100 * replay.main([str(trace), *settings, "--budget-bytes", str(int(c.gb * 1e9))])["token_hit_rate"]
        for c in todo
    ]
    rates = bench.compare(todo, {"a": bench.REPO, "b": bench.REPO}, config, 2, tmp_path)
    assert [rates[c.name]["a"] for c in todo] == expected == [rates[c.name]["b"] for c in todo]
    assert expected[1] > 0
    summary = bench.summarize(todo, rates, "a", "b")
    assert summary == {"tiny": {"cells": 2, "mean_change": 0.0, "up": 0, "down": 0}}
