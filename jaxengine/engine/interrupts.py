"""Ctrl-C held back while the engine's state is in flux.

A step donates the device pools to the compiled program and gets new ones back; a
`KeyboardInterrupt` between the two would leave the engine holding deleted buffers, and one
in the middle of the host bookkeeping would leave the scheduler half updated. Inside
`deferred_interrupts()` a SIGINT is only noted; it is raised as `KeyboardInterrupt` when the
block ends, at a point where everything is consistent again. Only the main thread receives
signals, so elsewhere the block changes nothing.
"""

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            if previous is signal.default_int_handler:
                raise KeyboardInterrupt
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)
