"""Compiled step executables kept for reuse: in memory for the engines a process creates, and
on disk so that a second start loads them without tracing.

JAX's own persistent compilation cache finds a compiled step only after tracing and lowering
it again, which costs about as long as loading it; this store keys each executable by
everything that decides it — the source of `jaxengine` and `pallas_kernels`, the JAX and XLA
versions and flags, the devices each argument lives on, and the shapes of every argument with
the step's static settings — and loads it straight from its file. A file that cannot be read
or loaded is treated as absent, and one that loads but cannot run is compiled again
(`StepExecutables`); either way the next compile overwrites it.

In memory, a step executable keeps no state between calls, so engines of equal settings share
one: every executable still held by some engine is found by its key, and of those an engine
waited for (loaded or compiled before a step could run), the last `KEPT_STEPS` are kept after
their engines are gone, so that the next engine of equal settings starts at once. That bound is
all a process that creates and frees engines keeps of them: XLA:CPU maps each executable's
code into memory (several hundred mappings per step of the default model, against Linux's
default limit of 65,530 a process). Shapes a background thread compiled go with their engine.
"""

import collections
import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import weakref
from pathlib import Path

import jax
import jaxlib.version
from jax.experimental import serialize_executable

logger = logging.getLogger(__name__)

_PACKAGES = ("jaxengine", "pallas_kernels")
KEPT_STEPS = 16  # executables kept for later engines once no engine holds them
# On XLA:CPU, a step loaded from a file into a process that has compiled steps itself has
# failed at run time ("NOT_FOUND: Function negate_power_fusion not found"), while loading at
# the start of a process works. So a process loads files only until it first compiles a step;
# after that it shares the executables it holds, and one that fails all the same is compiled
# again where it runs (`StepExecutables.run`).
_HELD: "weakref.WeakValueDictionary[str, jax.stages.Compiled]" = weakref.WeakValueDictionary()
_KEPT: "collections.OrderedDict[str, jax.stages.Compiled]" = collections.OrderedDict()  # oldest first
_lock = threading.Lock()  # warm-up threads and the background compile share the two above
_loading_allowed = True


def _share(key: str, executable: jax.stages.Compiled, keep: bool) -> None:
    """Makes `executable` the one engines of this process get for `key`; `keep`: also after
    the engines holding it are gone (one of the last `KEPT_STEPS`)."""
    with _lock:
        _HELD[key] = executable
        _KEPT.pop(key, None)  # an older executable of the key, replaced
        if keep:
            _KEPT[key] = executable
        while len(_KEPT) > KEPT_STEPS:
            _KEPT.popitem(last=False)


def _shared(key: str) -> jax.stages.Compiled | None:
    with _lock:
        executable = _HELD.get(key)
        if executable is not None and key in _KEPT:
            _KEPT.move_to_end(key)
        return executable


def num_kept_steps() -> int:
    """How many executables this process keeps for later engines (at most `KEPT_STEPS`)."""
    return len(_KEPT)


def forget_shared_steps() -> None:
    """Drops the executables kept for later engines (those engines still hold stay theirs)."""
    with _lock:
        _KEPT.clear()


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
    return repr(
        (
            jax.__version__,
            jaxlib.version.__version__,
            devices[0].client.platform_version,
            devices[0].platform,
            devices[0].device_kind,
            len(devices),
            os.environ.get("XLA_FLAGS", ""),
            _source_digest(),
        )
    )


def _devices(sharding) -> tuple[int, ...] | None:
    """The ids of the devices a sharding places its array on, in the order an executable
    assigns them (a sharding's text names its mesh's axes, not its devices)."""
    if sharding is None:
        return None
    assignment = getattr(sharding, "_device_assignment", None) or sorted(sharding.device_set, key=lambda d: d.id)
    return tuple(d.id for d in assignment)


def _avals(tree) -> str:
    leaves, treedef = jax.tree.flatten(tree)
    # The sharding and its devices too: the same shapes split over other devices, or on a
    # data-parallel replica's own devices, are another program.
    return repr(
        (
            treedef,
            [
                (
                    tuple(x.shape),
                    str(x.dtype),
                    str(getattr(x, "sharding", None)),
                    _devices(getattr(x, "sharding", None)),
                )
                for x in leaves
            ],
        )
    )


class StepStore:
    """Step executables shared in memory and serialized in `directory` (None: in memory only)."""

    def __init__(self, directory: str | Path | None):
        self.directory = Path(directory).expanduser() / "steps" if directory is not None else None

    def key(self, static: dict, *args) -> str:
        """The file name of the executable for these arguments (arrays or shape structs)."""
        text = repr((_environment(), sorted(static.items()), [_avals(a) for a in args]))
        return hashlib.sha256(text.encode()).hexdigest()

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The executable of `key`: one this process holds, else its file (None: neither)."""
        held = _shared(key)
        if held is not None or self.directory is None or not _loading_allowed:
            return held
        path = self.directory / f"{key}.bin"
        try:
            payload, in_tree, out_tree, device_ids = pickle.loads(path.read_bytes())
            devices = {d.id: d for d in jax.devices()}
            executable = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, execution_devices=[devices[i] for i in device_ids]
            )
        except FileNotFoundError:
            return None
        except Exception as err:  # a stale or damaged file: compile again
            logger.warning("ignoring the stored step executable %s (%s: %s)", path, type(err).__name__, err)
            return None
        _share(key, executable, keep=True)
        return executable

    def save(self, key: str, compiled: jax.stages.Compiled, keep: bool = True) -> None:
        """Shares a newly compiled executable with this process's engines (`keep`: and with
        later ones) and writes its file."""
        global _loading_allowed
        _loading_allowed = False
        _share(key, compiled, keep)
        if self.directory is None:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            # The devices it runs on, in its order: loading assigns them (by default, all of them).
            device_ids = [d.id for d in compiled.runtime_executable().local_devices()]
            blob = pickle.dumps((*serialize_executable.serialize(compiled), device_ids))
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False) as tmp:
                tmp.write(blob)
            os.replace(tmp.name, self.directory / f"{key}.bin")  # readers never see half a file
        except OSError as err:  # a read-only or full disk only costs the next start its compile
            logger.warning("cannot store a step executable in %s: %s", self.directory, err)
