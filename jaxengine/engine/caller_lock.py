"""The lock an `LLM` takes around engine work, which knows whether another thread waits for it.

The thread that runs steps (for every caller) releases the lock between steps and takes it
again at once. A thread waiting for it (`stats`, `abort`, `prompt_logits` from another thread)
is woken by the release, but the stepping thread may take the lock again first; yielding
(`time.sleep(0)`) lets the waiter in. A yield costs tens of microseconds (about 70 on a 2-core
CPU, near a tenth of the default model's one-sequence decode step there), so the stepping
thread yields only while someone waits (`contended`).
"""

import collections
import threading


class CallerLock:
    """A re-entrant lock (`with lock:`, `acquire`, `release`) with `contended`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._waiting: collections.deque[None] = collections.deque()  # one entry per thread blocked in acquire

    def acquire(self, blocking: bool = True) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self._waiting.append(None)  # deque operations are atomic across threads
        try:
            return self._lock.acquire()
        finally:
            self._waiting.pop()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> "CallerLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def contended(self) -> bool:
        """Whether some thread is blocked waiting for the lock."""
        return bool(self._waiting)
