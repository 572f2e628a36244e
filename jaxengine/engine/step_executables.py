"""A runner's compiled steps, one per step shape: loaded from the store, compiled up front, or
compiled on a background thread while larger shapes serve.

Any step fits a shape at least as large in every dimension (more padding), so an engine can
start serving as soon as the largest mixed and decode shapes are ready and let the others
arrive while it runs (`LLMEngine.warm_up`); a shape some step wanted moves to the front of
the queue. Loading and XLA's compiler release Python's lock (tracing holds it, so lowering
goes one shape at a time), so shapes are prepared on as many threads as the process has
cores; the background threads (one core left to serving) take the queue in order, store
each step, and stop after the compiles in flight when asked — when their engine is closed or
dropped, at the latest when the process exits — so the next start loads the rest. A loaded step that fails when run is compiled again
(`run`): a file one process left must never break another.
"""

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import TypeVar

import jax

from jaxengine.engine.sampler import SamplingBatch
from jaxengine.engine.step_store import StepStore
from jaxengine.models.batch import StepBatch

logger = logging.getLogger(__name__)

# tokens, sequences, checkpoint saves, decode, rows sampled per sequence, runs the drafter
ShapeKey = tuple[int, int, int, bool, int, bool]
Item = tuple[StepBatch, SamplingBatch, bool]  # an all-padding batch of a shape; decode or not

_LIVE: "weakref.WeakSet[StepExecutables]" = weakref.WeakSet()
T = TypeVar("T")


class StoredStepFailed(RuntimeError):
    """A step executable from the store failed at its first run and took the step's inputs with
    it; it has been compiled again, and the step must be run anew."""


def shape_key(batch: StepBatch, sampling: SamplingBatch, decode: bool) -> ShapeKey:
    return (
        batch.input_ids.shape[0],
        batch.kv_lens.shape[0],
        batch.save_seq.shape[0],
        decode,
        sampling.sample_rows.shape[1],
        sampling.runs_drafter,
    )


class StepExecutables:
    """The executables of one runner by shape key."""

    def __init__(
        self,
        lower: Callable[[StepBatch, SamplingBatch, bool], jax.stages.Lowered],
        file_key: Callable[[StepBatch, SamplingBatch, bool], str],
        store: StepStore,
    ):
        self._lower, self._file_key, self.store = lower, file_key, store
        self.ready: dict[ShapeKey, jax.stages.Compiled] = {}
        self.unproven: set[ShapeKey] = set()  # shapes from the store that have yet to run once
        self.recompiled_after_failure = 0  # loaded steps that failed when run and were compiled again
        self.compiled_on_demand = 0  # steps that waited for a compile: none after a warm-up
        self.compile_seconds: dict[ShapeKey, float] = {}  # lowering and compiling each compiled shape
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._queue: list[Item] = []  # the background threads' shapes, next first
        self._queue_lock = threading.Lock()
        _LIVE.add(self)

    def get(self, batch: StepBatch, sampling: SamplingBatch, decode: bool) -> jax.stages.Compiled:
        """The executable of this batch's shape, loaded or compiled now if not ready."""
        key = shape_key(batch, sampling, decode)
        executable = self.ready.get(key)
        if executable is None:
            executable = self._load(batch, sampling, decode)
            if executable is None:
                executable = self._compile(batch, sampling, decode)
                self.compiled_on_demand += 1
            self.ready[key] = executable
        return executable

    def run(
        self,
        batch: StepBatch,
        sampling: SamplingBatch,
        decode: bool,
        call: Callable[[jax.stages.Compiled], T],
        can_retry: Callable[[], bool],
    ) -> T:
        """`call(executable)` with this batch's step. A step that came from the store (a file,
        or another engine of this process) is waited for at its first run, where a broken one
        shows; if it fails, it is compiled here and replaces the stored one, and `call` runs
        again when `can_retry()` (its inputs survived), else `StoredStepFailed` says the step
        is lost and the next one runs the new executable."""
        key = shape_key(batch, sampling, decode)
        executable = self.get(batch, sampling, decode)
        try:
            result = call(executable)
            if key in self.unproven:
                jax.block_until_ready(result)
                self.unproven.discard(key)
            return result
        except Exception as err:
            if key not in self.unproven:
                raise
            logger.warning(
                "a stored step executable failed at its first run (%s: %s); compiling it again",
                type(err).__name__,
                str(err).splitlines()[0] if str(err) else "",
            )
            self.unproven.discard(key)
            self.ready[key] = executable = self._compile(batch, sampling, decode)
            self.recompiled_after_failure += 1
            if not can_retry():
                raise StoredStepFailed(f"a stored step executable failed and was compiled again: {err}") from err
        return call(executable)

    def prepare(
        self, items: list[Item], *, later: set[ShapeKey] = frozenset(), progress: Callable[[], None] | None = None
    ) -> None:
        """Makes every item's shape ready: stored ones are loaded and the others compiled, on
        a few threads; those in `later` that are not stored go to the background thread."""
        todo = [item for item in items if shape_key(*item) not in self.ready]
        # Every stored shape loads before any compiles: a process stops loading once it has
        # compiled a step itself (step_store), so one missing file costs one compile.
        missing = self._run_all(todo, self._load, progress)
        compile_now = [i for i in missing if shape_key(*todo[i]) not in later]
        self._run_all([todo[i] for i in compile_now], self._compile, progress)
        waiting = sorted(set(missing) - set(compile_now))
        if waiting:
            self._queue = [todo[i] for i in waiting]  # in the order given
            # A thread holds this object only while it compiles: an engine that is dropped is
            # freed, and its threads stop after the compiles in flight.
            self._threads = [
                threading.Thread(target=_compile_all, args=(weakref.ref(self),), daemon=True, name="jaxengine-compile")
                for _ in range(min(background_threads(), len(waiting)))
            ]
            for thread in self._threads:
                thread.start()

    def _run_all(
        self, items: list[Item], make: Callable[..., jax.stages.Compiled | None], progress: Callable[[], None] | None
    ) -> list[int]:
        """Makes each item's executable with `make` on a few threads; returns the indices of
        those it gave None for."""
        if not items:
            return []
        none = []
        with ThreadPoolExecutor(min(compile_threads(), len(items))) as pool:
            futures = {pool.submit(make, *item): i for i, item in enumerate(items)}
            for future in as_completed(futures):
                i, executable = futures[future], future.result()
                if executable is None:
                    none.append(i)
                    continue
                self.ready[shape_key(*items[i])] = executable
                if progress is not None:
                    progress()
        return sorted(none)

    def prefer(self, key: ShapeKey) -> None:
        """Moves a shape the background thread has yet to compile to the front of its queue
        (a step wanted it)."""
        with self._queue_lock:
            for i, item in enumerate(self._queue):
                if shape_key(*item) == key:
                    self._queue.insert(0, self._queue.pop(i))
                    return

    @property
    def compiling(self) -> bool:
        """Whether the background threads still have shapes to compile."""
        return any(thread.is_alive() for thread in self._threads)

    def wait(self) -> None:
        """Returns once the background threads have compiled every shape given to them (at
        once on one of them: the garbage collector may close an engine there)."""
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def stop(self) -> None:
        """Stops the background threads after the compiles in flight (the rest stay
        uncompiled) and returns once they have stopped."""
        self._stop.set()
        self.wait()

    def close(self) -> None:
        """Stops the background thread and lets go of every executable (those another engine
        holds stay its own; `step_store` keeps a bounded few for later engines)."""
        self.stop()
        self.ready.clear()
        self.unproven.clear()

    def _compile_next(self) -> bool:
        """Compiles the next shape of the background queue; False once there is none."""
        with self._queue_lock:
            if self._stop.is_set() or not self._queue:
                return False
            item = self._queue.pop(0)
        try:
            self.ready[shape_key(*item)] = self._compile(*item, waited=False)
        except Exception as err:  # the larger shapes it fell back to go on serving
            logger.warning("background compile of a step shape failed (%s: %s)", type(err).__name__, err)
        return True

    def _load(self, batch: StepBatch, sampling: SamplingBatch, decode: bool) -> jax.stages.Compiled | None:
        executable = self.store.load(self._file_key(batch, sampling, decode))
        if executable is not None:
            self.unproven.add(shape_key(batch, sampling, decode))
        return executable

    def _compile(
        self, batch: StepBatch, sampling: SamplingBatch, decode: bool, *, waited: bool = True
    ) -> jax.stages.Compiled:
        """Compiles a shape and stores it; `waited`: an engine could not go on without it (the
        store keeps those for later engines)."""
        start = time.perf_counter()
        executable = self._lower(batch, sampling, decode).compile()
        self.compile_seconds[shape_key(batch, sampling, decode)] = time.perf_counter() - start
        self.store.save(self._file_key(batch, sampling, decode), executable, keep=waited)
        return executable


def compile_threads() -> int:
    """Threads that load and compile steps before serving: one per core this process may use."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def background_threads() -> int:
    """Threads that compile while the engine serves: every core but the one that serves."""
    return max(1, compile_threads() - 1)


def _compile_all(owner: "weakref.ref[StepExecutables]") -> None:
    """A background thread: compiles its owner's queue while the owner lives and wants it."""
    while (steps := owner()) is not None and steps._compile_next():
        del steps  # between compiles, only the weak reference holds the owner


@atexit.register
def _stop_background_compiles() -> None:
    """An interpreter must not shut down under a compiling thread: wait for the one in flight."""
    for executables in list(_LIVE):
        executables.stop()
