"""Host malloc settings for running on the CPU backend, and giving freed memory back.

XLA:CPU allocates each step's scratch buffers when the step starts and frees them when it
ends. glibc serves blocks that large with a fresh `mmap`, so every step touches new pages and
takes one page fault per 4 KiB. Keeping freed memory in one heap instead — one arena, no
`mmap` for large blocks, no returning freed memory to the system — lets each step reuse the
previous one's pages.

The settings must be made before JAX starts its CPU backend: XLA's threads take their malloc
arena when they first allocate. `jaxengine` applies them when it is imported with
`JAXENGINE_MALLOC_TUNING=1` in the environment, only on Linux with glibc and only when JAX
will run on the CPU. They are off by default because they cost elsewhere: the process keeps
memory it has freed, and with one arena XLA's parallel compilation slows down. Long CPU runs
with large prefill steps gain; short ones lose (`BENCHMARKS.md`).
"""

import ctypes
import importlib.util
import os
import platform
import sys

ENV_VAR = "JAXENGINE_MALLOC_TUNING"

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_KEEP_FREED_BYTES = 1 << 30  # free memory at the heap's top before it goes back to the system


def _runs_on_cpu() -> bool:
    """Whether JAX's default backend will be the CPU, judged without starting it."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    # Accelerator backends come as plugins (CUDA, ROCm) or the TPU runtime.
    return importlib.util.find_spec("jax_plugins") is None and importlib.util.find_spec("libtpu") is None


def tune_malloc_for_cpu() -> bool:
    """Applies the settings when asked for and they apply here; returns whether it did."""
    if os.environ.get(ENV_VAR) != "1" or sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return False
    if not _runs_on_cpu():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES))
    return all(mallopt(param, value) == 1 for param, value in settings)


def give_back_freed_memory() -> None:
    """Returns the heap memory the process has freed to the system (glibc's `malloc_trim`),
    after an engine is shut down: glibc keeps what XLA's threads freed in their arenas, so a
    process that creates and frees engines would otherwise grow well past its first engine's
    resident memory. Nothing elsewhere."""
    if sys.platform == "linux" and platform.libc_ver()[0] == "glibc":
        ctypes.CDLL(None).malloc_trim(0)
