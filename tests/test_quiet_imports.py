"""jaxengine imports transformers without its "PyTorch was not found" notice."""

import subprocess
import sys

# Runs an import in a fresh interpreter that cannot see PyTorch (as on a machine without it),
# then prints whether transformers' advisory switch is left set.
HIDDEN_TORCH = """
import importlib, importlib.util, os, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, package=None: None if name.split(".")[0] == "torch" else real(name, package)
importlib.import_module(sys.argv[1])
print("switch left set:", "TRANSFORMERS_NO_ADVISORY_WARNINGS" in os.environ)
"""


def _import_without_torch(module: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDDEN_TORCH, module], capture_output=True, text=True, timeout=300)


def test_importing_jaxengine_prints_no_pytorch_notice():
    control = _import_without_torch("transformers")
    assert "PyTorch was not found" in control.stderr + control.stdout  # the notice this test guards against
    run = _import_without_torch("jaxengine")
    assert run.returncode == 0, run.stderr
    assert "PyTorch was not found" not in run.stderr + run.stdout
    assert "switch left set: False" in run.stdout
