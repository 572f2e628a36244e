"""One thread that steps an `LLM`'s engine for every caller and hands each request its
outputs as they come: what a server runs (`jaxengine serve`).

Callers on other threads (HTTP handlers) `submit` requests, already validated by then, and
receive their increments through the callback they gave, called on the loop's thread right
after the step that produced them (a server hands them on to its event loop). A caller that
goes away `abort`s its requests: they are dropped before the next step and their pages and
slots released. The loop steps whenever a request is unfinished and otherwise sleeps.
Everything `LLM` promises its callers holds here too, since the loop steps through the same
`LLM.step_once` as `generate` does; the two may even run at once.
"""

import logging
import threading
from collections.abc import Callable

from jaxengine.engine.increments import Increments
from jaxengine.engine.llm import LLM, Prompt
from jaxengine.engine.outputs import StreamOutput
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Sequence, Status

logger = logging.getLogger("jaxengine")

# Called with a request's increments (one per sample with news) after a step; with an
# exception instead when the engine failed and the request was aborted.
Listener = Callable[[list[StreamOutput] | BaseException], None]


class EngineLoop:
    """Steps `llm` on a daemon thread while requests are unfinished (`start`, `stop`)."""

    def __init__(self, llm: LLM):
        self.llm = llm
        self._listeners: dict[int, tuple[Increments, Listener]] = {}  # by id() of the request's samples
        self._lock = threading.Lock()  # guards _listeners
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="jaxengine-engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Aborts the unfinished requests and ends the thread after its step in flight."""
        with self._lock:
            seqs = [s for increments, _ in self._listeners.values() for s in increments.seqs]
        self.abort(seqs)
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        listener: Listener,
        *,
        texts: list[str | None] | None = None,
    ) -> list[list[Sequence]]:
        """Validates every prompt, then queues them all (a ValueError naming the prompt and
        the field if one is bad, before anything is queued); returns each prompt's samples.
        The listener hears every prompt's increments (`StreamOutput.index`: which prompt).
        `texts`: the prompts' text where they are given as token ids (a rendered chat)."""
        if self._stopping:
            raise RuntimeError("the engine loop is stopping; no new requests are taken")
        groups = self.llm._submit(prompts, params, texts=texts)
        with self._lock:
            for seqs in groups:
                self._listeners[id(seqs)] = (Increments(self.llm.engine, seqs), listener)
        self._wake.set()
        return groups

    def abort(self, seqs: list[Sequence]) -> None:
        """Aborts these samples before the next step (at once if none is running); their
        listener hears no more."""
        ids = {id(s) for s in seqs}
        with self._lock:
            for key, (increments, _) in list(self._listeners.items()):
                if any(id(s) in ids for s in increments.seqs):
                    del self._listeners[key]
        unfinished = [s for s in seqs if s.status is not Status.FINISHED]
        if unfinished:
            self.llm._abort_soon(unfinished)
            self._wake.set()

    def load(self) -> tuple[int, int]:
        """(running, waiting) samples in the engine, whoever submitted them."""
        with self.llm._lock:
            while True:
                try:  # a request submitted meanwhile (without the lock) may change the mapping
                    seqs = list(self.llm.engine.requests.values())
                    break
                except RuntimeError:
                    continue
            queued = len(self.llm._inbox)
        running = sum(s.status in (Status.RUNNING, Status.COMPLETING) for s in seqs)
        return running, queued + sum(s.status is Status.WAITING for s in seqs)

    @property
    def num_requests(self) -> int:
        """Requests submitted and not yet finished (or aborted)."""
        with self._lock:
            return len(self._listeners)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait()
            self._wake.clear()  # before looking for work: a submit after this wakes the next wait
            while not self._stopping:
                work = self.llm.has_work
                try:
                    # With no work left this still delivers: another thread's step (`generate`
                    # beside this loop) may have been the one that finished these requests.
                    self.llm.step_once(after=self._deliver)
                except Exception as err:  # the engine is consistent again (LLMEngine.step)
                    logger.exception("engine step failed; aborting the requests in flight")
                    self._fail_all(err)
                if not work:
                    break

    def _deliver(self) -> None:
        """Hands each request's news to its listener (on this thread, under the LLM's lock)."""
        with self._lock:
            listeners = list(self._listeners.items())
        for key, (increments, listener) in listeners:
            events = increments.take()
            if increments.done:
                with self._lock:
                    self._listeners.pop(key, None)
            if events:
                _call(listener, events)

    def _fail_all(self, err: Exception) -> None:
        with self._lock:
            listeners = list(self._listeners.values())
            self._listeners.clear()
        for increments, listener in listeners:
            self.llm._abort([s for s in increments.seqs if s.status is not Status.FINISHED])
            _call(listener, err)


def _call(listener: Listener, news) -> None:
    """A listener's failure is its caller's (logged), never the loop's."""
    try:
        listener(news)
    except Exception:
        logger.exception("a request's listener failed")
