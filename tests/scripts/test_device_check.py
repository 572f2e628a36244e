"""The device check script: its quick run on CPU (kernels in interpret mode) reports every
check and passes them, its deadline skips checks, and its cost bookkeeping."""

import json
from pathlib import Path

import jax
import pytest

from tests.scripts.load_script import load_script

device_check = load_script("device_check")

KERNEL_ROWS = [
    "attention decode bf16",
    "attention mixed bf16",
    "ssd prefill bf16",
    "ssd prefill f32",
    "ssd decode-ish bf16",
    "selective prefill bf16",
    "selective decode-ish bf16",
    "gated delta prefill bf16",
    "gated delta decode-ish bf16",
]
ON_GPU = jax.default_backend() == "gpu"
ENGINE_ROWS = [
    "engine decode b4",
    "engine prefill 4x8",
    "engine load / first runs",
    "engine output b4, async vs synchronous loop",
    "engine first tokens auto vs ref",
    "engine tensor parallel",
    "engine verify b4",
    "engine verify b4 draft_model",
]
STARTUP_ROW = "startup default model"


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict]:
    path = tmp_path / "tmp.json"
    status = device_check.main(["--quick", "--json", str(path), *argv])
    return status, json.loads(path.read_text())


@pytest.mark.slow
def test_quick_run_checks_kernels_and_engine(tmp_path, capsys):
    status, report = _run(tmp_path)
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == ["roofline", *KERNEL_ROWS, *ENGINE_ROWS, STARTUP_ROW]
    assert status == 0 and report["passed"]
    assert report["device"] and report["jax"] and report["date"] and report["interpret"] == (not ON_GPU)
    assert rows["roofline"]["details"]["bandwidth"] > 0 and rows["roofline"]["details"]["matmul_rate"] > 0
    for name in KERNEL_ROWS:
        row = rows[name]
        assert row["status"] == "pass", row
        assert 0 <= row["error"] <= row["tol"]
        assert row["kernel"] > 0 and row["reference"] > 0 and row["kernel_floor_pct"] > 0
    assert rows["ssd prefill f32"]["details"]["checks"][-1] == {"name": "row layout", "error": 0.0, "tol": 0.0}
    for name in ENGINE_ROWS[:2]:
        assert rows[name]["status"] == "ok" and rows[name]["kernel"] > 0 and rows[name]["reference"] > 0
    decode = rows["engine decode b4"]["details"]
    assert decode["auto"]["kernels"] == ("auto" if ON_GPU else "pallas-interpret-gpu")
    assert decode["reference"]["kernels"] == "reference"
    assert decode["auto"]["recompiles"] == 0 and decode["reference"]["recompiles"] == 0
    for mode in ("auto", "reference"):  # where the steps' time went
        assert decode[mode]["decode_timeline"]["step_device_wait_ms"] > 0
        assert 0 <= decode[mode]["decode_timeline"]["device_idle_fraction"] < 1
        assert decode[mode]["prefill_timeline"]["step_dispatch_ms"] > 0
    ops = decode["auto"]["top_device_ops"]
    assert ops and all(op["total_ms"] > 0 and op["calls"] > 0 for op in ops)
    assert sum(op["share"] for op in ops) <= 1 + 1e-9
    assert rows["engine first tokens auto vs ref"]["status"] == "pass"
    tp = rows["engine tensor parallel"]  # the suite's eight CPU devices: the largest size the heads split over
    assert tp["status"] == "pass" and tp["details"]["tensor_parallel_size"] > 1 and tp["kernel"] > 0, tp
    for name in ENGINE_ROWS[-2:]:
        verify = rows[name]
        assert verify["status"] == "pass" and verify["details"]["verifies"] > 0  # recompiles: reported only (drafts
        # depend on the model's tokens, so the untimed runs may not reach every verify shape)
    draft = rows["engine verify b4 draft_model"]["details"]
    assert draft["accepted"] >= 0.9 * draft["drafted"]  # the model drafting for itself (bfloat16: near-ties may differ)
    startup = rows[STARTUP_ROW]
    times = startup["details"]
    assert startup["status"] == "ok" and 0 < times["ready_s"] < times["first_output_s"] <= times["all_shapes_s"]
    assert times["compile_seconds"] and all(t > 0 for t in times["compile_seconds"].values())
    assert len(times["shapes"]) == len(times["compile_seconds"]) and all(r["step_ms"] > 0 for r in times["shapes"])
    assert times["shapes_buying_nothing"] == [r["shape"] for r in times["shapes"] if r["buys_nothing"]]
    # The table comes last: its header, then one line per row.
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert lines[-len(rows) - 1].startswith("check") and lines[-1].startswith(STARTUP_ROW)


def test_deadline_skips_every_check(tmp_path):
    status, report = _run(tmp_path, "--budget-s", "0")
    statuses = {r["name"]: r["status"] for r in report["rows"]}
    assert statuses.pop("roofline") == "ok"
    assert list(statuses) == [*KERNEL_ROWS, *ENGINE_ROWS, STARTUP_ROW]
    assert set(statuses.values()) == {"skipped (time)"}
    assert status == 0 and report["passed"]


def test_parts_selects_and_rejects(tmp_path):
    status, report = _run(tmp_path, "--budget-s", "0", "--parts", "engine")
    assert [r["name"] for r in report["rows"]] == ["roofline", *ENGINE_ROWS[:-2]]
    status, report = _run(tmp_path, "--budget-s", "0", "--parts", "verify")
    assert [r["name"] for r in report["rows"]] == ["roofline", *ENGINE_ROWS[-2:]]
    status, report = _run(tmp_path, "--budget-s", "0", "--parts", "startup")
    assert [r["name"] for r in report["rows"]] == ["roofline", STARTUP_ROW]
    with pytest.raises(SystemExit):
        device_check.parse_args(["--parts", "kernels,gpu"])


@pytest.mark.skipif(ON_GPU, reason="on a GPU this would run the full check")
def test_full_run_needs_a_gpu(tmp_path):
    path = tmp_path / "full.json"
    assert device_check.main(["--json", str(path)]) == 2  # the real shapes would take hours interpreted
    assert not path.exists()


def test_costs():
    ssd = device_check.SsdCase("s", (300, 10), (250, 0), 0, 1, 1, 64, 16, chunk_size=256, dtype="float32")
    assert device_check.ssd_rows(ssd) == [6, 256, 38, 10]  # chunks aligned to absolute positions
    attention = device_check.AttentionCase("a", (3, 1), (5, 8), 2, q_heads=4, kv_heads=2, head_dim=8, dtype="float32")
    num_bytes, flops = device_check.attention_cost(attention)
    assert num_bytes == 2 * 13 * 2 * 8 * 4 + 2 * 6 * 4 * 8 * 4  # keys and values once, q and out
    assert flops == 4 * 4 * 8 * (3 + 4 + 5 + 8)  # visible keys: 3, 4, 5 for the prefill, 8 for the decode
    selective = device_check.SelectiveCase("m", (3,), (0,), 1, channels=4, state_size=2, chunk_size=4, dtype="float32")
    num_bytes, flops = device_check.selective_cost(selective)
    # x, dt, B and C of 4 tokens (padding included), y, then the initial, final and one row's states
    assert num_bytes == 4 * (4 * 4 + 4 * 4 + 2 * 2 * 4) + 4 * 4 * 4 + 3 * 4 * 2 * 4
    assert flops == 6 * 4 * 4 * 2
    delta = device_check.GatedDeltaCase(
        "d", (3,), (0,), 1, key_heads=1, value_heads=2, key_dim=2, value_dim=4, chunk_size=4, dtype="float32"
    )
    num_bytes, flops = device_check.gated_delta_cost(delta)
    # q, k, v, g and beta of 4 tokens (padding included), o, then the initial, final and one row's states
    assert num_bytes == 4 * (2 * 2 * 4 + 2 * 4 * 4 + 2 * 2 * 4) + 4 * 2 * 4 * 4 + 3 * 2 * 2 * 4 * 4
    # one row of 3 tokens per value head: k k^T and q k^T, the solve, three state products, lower(q k^T) V'
    assert flops == 2 * (2 * 3 * 4 * 2 + 3 * 2 * (2 + 4) + 6 * 3 * 2 * 4 + 3 * 4 * 4)


def test_engine_report_when_a_mode_did_not_run():
    spec = device_check.quick_plan().engine
    sizes = device_check.ModelSizes(parameters=1000, weight_bytes=2000, embedding_bytes=500, layer_parameters=800)
    auto = device_check.EngineRun("auto", 1.0, 9.0, 400.0, 300.0, 2000.0, 250.0, 0, [[1, 2, 3], [4, 5, 6]], [7, 8])
    roofline = device_check.Roofline(bandwidth=1e9, matmul_rate=1e12)
    rows = device_check.engine_report(spec, sizes, {"auto": auto, "reference": "skipped (time)"}, roofline)
    assert [r.name for r in rows] == ENGINE_ROWS[:5]  # the tensor-parallel and verify rows come from runs of their own
    overlap = rows[3]
    assert overlap.kernel == 300.0 and overlap.reference == 250.0 and overlap.speedup == pytest.approx(1.2)
    decode = rows[0]
    assert decode.status == "ok" and decode.kernel == 400.0 and decode.reference is None and decode.speedup is None
    assert decode.note == "reference: skipped (time)" and decode.kernel_floor_pct > 0
    assert rows[-1].status == "skipped (time)"

    reference = device_check.EngineRun(
        "reference", 1.0, 5.0, 200.0, 100.0, 1000.0, 90.0, 0, [[1, 2, 0], [9, 5, 6]], [7, 8]
    )
    rows = device_check.engine_report(spec, sizes, {"auto": auto, "reference": reference}, roofline)
    assert rows[0].speedup == 2.0 and rows[1].speedup == 2.0 and rows[2].speedup is None  # load times: no speedup
    first = rows[-1]
    assert first.error == 0.25 and first.status == "pass"  # 1 of 4 first tokens differs
    assert first.details["mean_common_prefix"] == 1.0  # 2 tokens agree, then none
