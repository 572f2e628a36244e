"""The CPU malloc settings: a step's scratch memory is reused, not faulted in anew."""

import json
import os
import subprocess
import sys

import pytest

from jaxengine import host_memory

SETTLING_CALLS, MEASURED_CALLS = 10, 30
SCRATCH_BYTES = 128 * 2**20

# Runs a jitted function whose scratch (128 MiB for a [4096, 4096] float32 cumulative
# sum) is allocated and freed on every call, and prints how many of the measured calls,
# after some to settle, faulted more than a quarter of that scratch in anew. With the
# settings freed blocks stay in the heap; small allocations between calls fragment its
# holes, so a few calls still grow it, mostly early on.
PROBE = f"""
import json, resource
import jaxengine
import jax, jax.numpy as jnp
x = jnp.ones((4096, 4096), jnp.float32)
f = jax.jit(lambda x: jnp.cumsum(x, axis=0)[-1].sum())
faulting = 0
for call in range({SETTLING_CALLS + MEASURED_CALLS}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    f(x).block_until_ready()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    faulting += call >= {SETTLING_CALLS} and faults > {SCRATCH_BYTES // 4096 // 4}
print(json.dumps(faulting))
"""


def calls_that_fault_their_scratch_in(**env: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_settings_let_cpu_steps_reuse_their_scratch_memory():
    untuned = calls_that_fault_their_scratch_in(**{host_memory.ENV_VAR: "0"})
    tuned = calls_that_fault_their_scratch_in(**{host_memory.ENV_VAR: "1"})
    assert untuned == MEASURED_CALLS, f"without the settings every call should fault its scratch in ({untuned})"
    assert tuned <= MEASURED_CALLS // 2, f"{tuned} of {MEASURED_CALLS} calls faulted their scratch in anew"


@pytest.mark.parametrize(
    "env",
    [
        {"JAX_PLATFORMS": "cuda", host_memory.ENV_VAR: "1"},
        {"JAX_PLATFORMS": "tpu,cpu", host_memory.ENV_VAR: "1"},
        {"JAX_PLATFORMS": "cpu", host_memory.ENV_VAR: "0"},
        {"JAX_PLATFORMS": "cpu", host_memory.ENV_VAR: ""},
    ],
)
def test_settings_are_left_alone_off_the_cpu_or_unless_asked_for(monkeypatch, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert host_memory.tune_malloc_for_cpu() is False


def test_importing_jaxengine_leaves_malloc_alone_by_default():
    import jaxengine

    assert jaxengine.MALLOC_TUNED is (os.environ.get(host_memory.ENV_VAR) == "1")
