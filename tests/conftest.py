"""Shared test setup: transformers kept quiet, XLA:CPU's compile settings, eight CPU devices, a
home of the run's own, and the property tests' example counts."""

import logging
import os
import tempfile
import warnings

import jax
import pytest
from hypothesis import settings
from transformers import logging as hf_logging

hf_logging.set_verbosity_error()
# The suite's time is mostly XLA:CPU compiling tiny programs. LLVM's optimizations at level 0
# halve it, and XLA:CPU's older loop emitters for fused ops halve what is left; the programs
# compute the same values and run as fast as these tests need (subprocesses inherit the flags).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
).strip()
# Eight CPU devices, for the tensor-parallel tests; an engine uses one unless told otherwise.
jax.config.update("jax_num_cpu_devices", 8)
# Engines built with the default compilation_cache_dir (~/.cache/jaxengine/xla) store their
# steps under a home of this run's own: a test never loads steps another run stored.
os.environ["HOME"] = tempfile.mkdtemp(prefix="jaxengine-tests-home-")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")


@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs_after_each_module():
    """Frees every compiled program after a test module. Each CPU program holds memory
    mappings, and one process compiling the whole suite's programs (the Pallas interpreters'
    especially) ran into the kernel's map-count limit and crashed inside XLA's compiler."""
    yield
    jax.clear_caches()


@pytest.fixture(autouse=True)
def _restore_the_engine_logger():
    """`jaxengine` commands run in-process give the `jaxengine` logger a handler on the
    stderr of their test (pytest's capture, closed afterwards) and stop it propagating; put it
    back, so that what a later test logs reaches pytest's log capture whatever the order."""
    logger = logging.getLogger("jaxengine")
    saved = logger.handlers[:], logger.propagate, logger.level
    yield
    logger.handlers[:], logger.propagate, logger.level = saved


def pytest_configure(config: pytest.Config) -> None:
    """The default run (`-m 'not slow'`) tries a quarter of each property test's examples
    (`property_examples.py`); any other selection, or the thorough profile named, all of them."""
    from tests import property_examples  # noqa: F401  (registers the profiles)

    if config.getoption("hypothesis_profile", None) is None:
        settings.load_profile("default-run" if config.getoption("markexpr") == "not slow" else "thorough")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Runs the kernel tests first, in a fresh process state: the Pallas interpreters build
    the largest programs of the suite."""
    items.sort(key=lambda item: "pallas_kernels" not in item.nodeid)
