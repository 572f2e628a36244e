"""Many hosts on one machine: `jaxengine run` as two processes on 127.0.0.1, one CPU device each,
joined by distributed_init_addr / num_nodes / node_rank into one tensor-parallel engine — the
README's two-host command — that gives transformers' greedy tokens, and how a process that
cannot reach the other, or loses it, stops."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.engine.conftest import ENGINE_ARGS
from tests.models.tiny_models import hf_greedy

REPO = Path(__file__).resolve().parents[2]
SHARED = list(range(40, 64))  # a prefix the second and third prompts share: a prefix hit
PROMPTS = [list(range(3, 30)), SHARED + [7, 8, 9], SHARED + [11, 12]]
MAX_TOKENS = 6
# One sequence at a time (the third prompt finds the second's pages) and few step shapes to compile.
ARGS = {**ENGINE_ARGS, "max_num_seqs": 1, "max_num_batched_tokens": 32, "warm_up": False}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, model: Path, **engine) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt_token_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    config = {
        "model": str(model),
        "engine": {
            **ARGS,
            "compilation_cache_dir": None,
            "tensor_parallel_size": 2,
            "distributed_init_addr": f"127.0.0.1:{_free_port()}",
            "num_nodes": 2,
            **engine,
        },
        "sampling": {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True},
        "input": str(prompts),
        "output": str(tmp_path / "outputs.jsonl"),
        "metrics": str(tmp_path / "metrics.json"),
        "progress": False,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(config: Path, rank: int) -> subprocess.Popen:
    """`jaxengine run CONFIG --node-rank RANK` in a fresh process with one CPU device."""
    return _python(["-m", "jaxengine", "run", str(config), "--node-rank", str(rank)])


def _python(args: list[str]) -> subprocess.Popen:
    """`python ARGS` in a fresh process with one CPU device."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"no exit within {timeout} s:\n{out}\n{err}")
    return process.returncode, out, err


def test_two_processes_give_the_tokens_of_one(tmp_path, tiny_models):
    model, hf_model = tiny_models["bamba"]
    config = _config(tmp_path, model)
    leader, follower = _start(config, 0), _start(config, 1)
    (rc0, _, err0), (rc1, out1, err1) = _finish(leader), _finish(follower)
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    records = [json.loads(line) for line in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [r["token_ids"] for r in records] == [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS]
    assert records[2]["num_cached_tokens"] > 0  # the shared prefix hit on process 0's cache
    steps = int(out1.split("ran process 0's ")[1].split()[0])
    assert steps >= MAX_TOKENS


def test_a_follower_that_reaches_nothing_stops_within_the_timeout(tmp_path, tiny_models):
    config = _config(tmp_path, tiny_models["bamba"][0], distributed_timeout_s=2)
    start = time.monotonic()
    rc, _, err = _finish(_start(config, 1), timeout=120)
    assert rc != 0
    assert "distributed_init_addr" in err and "nothing answered there within distributed_timeout_s=2" in err
    assert time.monotonic() - start < 60


def test_when_a_follower_dies_process_0_stops_with_an_error(tmp_path, tiny_models):
    config = _config(tmp_path, tiny_models["bamba"][0], distributed_timeout_s=10)
    leader, follower = _start(config, 0), _start(config, 1)
    # Once the follower has built its engine (after joining), it goes.
    for line in follower.stderr:
        if "prefix cache:" in line:
            break
    follower.send_signal(signal.SIGKILL)
    follower.communicate()
    start = time.monotonic()
    rc, _, err = _finish(leader, timeout=120)
    assert rc != 0
    # Our error, gloo's, or (when the machine is loaded and the coordination service notices
    # first) JAX's own: each says the other process is gone.
    lost = ("lost the other processes", "Gloo", "distributed service detected fatal errors")
    assert any(message in err for message in lost), err[-2000:]
    assert time.monotonic() - start < 90
    assert not (tmp_path / "outputs.jsonl").exists()


# Process 0 sends a call while a slow computation runs on its device, then runs the call's
# method itself; the follower runs it too. Prints how long the send took and the computation.
_SEND_WHILE_BUSY = """
import sys, time
import jax, jax.numpy as jnp
from jaxengine.engine import multihost
multihost.join(sys.argv[1], 2, int(sys.argv[2]), 60)
lockstep = multihost.Lockstep()

class Runner:
    def mark(self, value):
        print("mark", value, flush=True)

x = jnp.ones((1500, 1500), jnp.float32)
slow = jax.jit(lambda x: jax.lax.fori_loop(0, 12, lambda i, y: jnp.tanh(y @ x), x))
slow(x).block_until_ready()
if jax.process_index() == 0:
    start = time.perf_counter()
    slow(x).block_until_ready()
    alone = time.perf_counter() - start
    busy = slow(x)  # in flight while the call is sent
    start = time.perf_counter()
    lockstep.send("mark", 7)
    sent = time.perf_counter() - start
    busy.block_until_ready()
    lockstep.stop()
    print(f"sent {sent:.4f} s, computation {alone:.4f} s", flush=True)
else:
    print("calls", lockstep.follow(Runner()), flush=True)
"""


def test_process_0_sends_a_step_without_waiting_for_the_step_in_flight(tmp_path):
    """Async scheduling on several processes: process 0 sends step N + 1's call while step N
    runs on its device (a broadcast over the devices would wait for it)."""
    script = tmp_path / "send_while_busy.py"
    script.write_text(_SEND_WHILE_BUSY)
    address = f"127.0.0.1:{_free_port()}"
    leader, follower = _python([str(script), address, "0"]), _python([str(script), address, "1"])
    (rc0, out0, err0), (rc1, out1, err1) = _finish(leader, timeout=120), _finish(follower, timeout=120)
    assert rc0 == 0, err0
    assert rc1 == 0, err1
    assert "mark 7" in out1 and "calls 1" in out1
    sent, alone = (float(out0.split(word)[1].split()[0]) for word in ("sent", "computation"))
    assert alone > 0.05, out0  # long enough for the comparison to mean something
    assert sent < alone / 4, out0
