"""The replay benchmark's runner: one version's replay in a process of its own, read back."""

import json
from pathlib import Path

from jaxengine.run_config import DEFAULT_MODEL
from tests.scripts.load_script import load_script

bench = load_script("bench_replay_against_revision")
replay = load_script("replay_prefix_trace")


def test_a_replay_in_its_own_process_reports_what_the_replay_in_this_one_does(tmp_path: Path):
    trace = tmp_path / "trace.jsonl"
    prefix = list(range(1, 41))
    lines = [(prefix + [k] * 10, [7] * 4) for k in (101, 102, 103)]
    trace.write_text(
        "".join(
            json.dumps({"input_tokens": p, "output_tokens": o, "session_id": i}) + "\n"
            for i, (p, o) in enumerate(lines)
        )
    )
    args = [str(trace), "--model-config", str(DEFAULT_MODEL / "config.json"), "--budget-bytes", "1e9"]
    here = replay.main(args)
    run = bench.run_replay(bench.REPO, args, tmp_path / "out.json")
    assert run["hits"] == [r["hit_tokens"] for r in here["per_request"]] and sum(run["hits"]) > 0
    assert run["token_hit_rate"] == here["token_hit_rate"] and run["seconds"] > 0 and run["peak_mib"] > 10
