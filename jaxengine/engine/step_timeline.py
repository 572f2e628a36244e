"""Where each engine step's time goes, from the host's clock: scheduling and building the
batch, dispatching the compiled step, waiting for the device, and processing its tokens;
and the gap the device sits idle between two steps (from the moment the host saw the last
step's tokens ready until it dispatched the next).

With async scheduling the host dispatches step N + 1 before it reads step N's tokens, so
while the host is the faster of the two the device never waits (gap 0); the host checks
whether N was done before it dispatched N + 1, so a gap is never missed, though it may be
counted from a little after the device's last work ended (a lower bound)."""

import collections
import dataclasses
import statistics

WINDOW = 1024  # steps the medians are taken over (the most recent)


@dataclasses.dataclass
class StepTimes:
    """One step's phases, in seconds."""

    host_before: float  # scheduling and building the batch
    dispatch: float  # handing the compiled step to the device
    device_wait: float  # the host's wait for its tokens (0 if they were ready when it looked)
    host_after: float  # acceptance, stops, detokenizing, cache bookkeeping (the next step runs meanwhile, async)
    idle_gap: float | None  # the device's idle time before this step (None for the first)


class StepTimeline:
    """Step times of an engine (`record` per step; `as_dict` for stats)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets every step so far (a benchmark's measured run starts here)."""
        self.recent: collections.deque[StepTimes] = collections.deque(maxlen=WINDOW)
        self.busy_seconds = 0.0  # device: from dispatch (or the step before's end) to done, summed
        self.idle_seconds = 0.0  # device idle between steps, summed
        self._last_ready: float | None = None

    def record(
        self, start: float, dispatched_at: float, dispatched: float, wait_start: float, ready: float, end: float
    ) -> None:
        """A step (recorded in dispatch order) that began at `start`, began its dispatch at
        `dispatched_at`, returned from it at `dispatched`, was waited for from `wait_start`,
        was seen done at `ready` (perhaps before `wait_start`: it was done by then) and was
        processed by `end` (perf_counter seconds)."""
        last = self._last_ready
        gap = None if last is None else max(0.0, dispatched_at - last)
        self._last_ready = ready
        times = StepTimes(
            dispatched_at - start,
            dispatched - dispatched_at,
            max(0.0, ready - wait_start),
            end - max(ready, wait_start),
            gap,
        )
        self.recent.append(times)
        self.busy_seconds += ready - (dispatched_at if last is None else max(dispatched_at, last))
        self.idle_seconds += gap or 0.0

    def pause(self) -> None:
        """The engine ran out of work: the time until the next step is not a step's gap."""
        self._last_ready = None

    def as_dict(self) -> dict:
        """Medians over the recent steps (milliseconds) and the device's idle fraction since start."""
        steps = list(self.recent)

        def median_ms(field: str) -> float:
            values = [getattr(t, field) for t in steps if getattr(t, field) is not None]
            return 1000 * statistics.median(values) if values else 0.0

        total = self.busy_seconds + self.idle_seconds
        return {
            "step_host_before_ms": median_ms("host_before"),
            "step_dispatch_ms": median_ms("dispatch"),
            "step_device_wait_ms": median_ms("device_wait"),
            "step_host_after_ms": median_ms("host_after"),
            "step_device_idle_gap_ms": median_ms("idle_gap"),
            "device_idle_fraction": self.idle_seconds / total if total else 0.0,
        }
