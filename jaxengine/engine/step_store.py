"""Compiled step executables kept on disk, so that a second start loads them without tracing.

JAX's own persistent compilation cache finds a compiled step only after tracing and lowering
it again, which costs about as long as loading it; this store keys each executable by
everything that decides it — the source of `jaxengine` and `pallas_kernels`, the JAX and XLA
versions and flags, the devices, and the shapes of every argument with the step's static
settings — and loads it straight from its file. A file that cannot be read or loaded is
treated as absent (and overwritten by the next compile).
"""

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import weakref
from pathlib import Path

import jax
import jaxlib.version
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_PACKAGES = ("jaxengine", "pallas_kernels")
# On XLA:CPU, a step loaded from a file into a process that has compiled steps itself fails at
# run time ("NOT_FOUND: Function negate_power_fusion not found"), while loading at the start
# of a process works. So a process loads files only until it first compiles a step; after
# that it shares the executables it holds (a step executable keeps no state between calls).
_LOADED: dict[str, jax.stages.Compiled] = {}  # kept: a loaded step is never loaded twice
_COMPILED: "weakref.WeakValueDictionary[str, jax.stages.Compiled]" = weakref.WeakValueDictionary()
_loading_allowed = True


@functools.cache
def _source_digest() -> str:
    """A hash of every Python file of the engine and its kernels."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _environment() -> str:
    devices = jax.devices()
    return repr((
        jax.__version__,
        jaxlib.version.__version__,
        devices[0].client.platform_version,
        devices[0].platform,
        devices[0].device_kind,
        len(devices),
        os.environ.get("XLA_FLAGS", ""),
        _source_digest(),
    ))


def _avals(tree) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    # The sharding too: the same shapes split over other devices are another program.
    return repr((treedef, [(tuple(x.shape), str(x.dtype), str(getattr(x, "sharding", None))) for x in leaves]))


class StepStore:
    """Serialized step executables in `directory` (None: keep nothing)."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory).expanduser() / "steps" if directory is not None else None

    def key(self, static: dict, *args) -> str:
        """The file name of the executable for these arguments (arrays or shape structs)."""
        text = repr((_environment(), sorted(static.items()), [_avals(a) for a in args]))
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> jax.stages.Compiled | None:
        if self.directory is None:
            return None
        held = _LOADED.get(key)
        held = _COMPILED.get(key) if held is None else held
        if held is not None or not _loading_allowed:
            return held
        path = self.directory / f"{key}.bin"
        try:
            payload, in_tree, out_tree = pickle.loads(path.read_bytes())
            executable = _LOADED[key] = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
            return executable
        except FileNotFoundError:
            return None
        except Exception as err:  # a stale or damaged file: compile again
            logger.warning("ignoring the stored step executable %s (%s: %s)", path, type(err).__name__, err)
            return None

    def save(self, key: str, compiled: jax.stages.Compiled) -> None:
        global _loading_allowed
        _loading_allowed = False
        if self.directory is None:
            return
        _COMPILED[key] = compiled
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as tmp:
                tmp.write(blob)
            os.replace(tmp.name, self.directory / f"{key}.bin")  # readers never see half a file
        except OSError as err:  # a read-only or full disk only costs the next start its compile
            logger.warning("cannot store a step executable in %s: %s", self.directory, err)
