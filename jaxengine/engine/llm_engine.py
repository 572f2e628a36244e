"""The engine loop: requests in, scheduled and sampled steps, tokens out. With async
scheduling (the default) each step is dispatched before the tokens of the one before are
read, so the device does not wait for the host (docs/design.md, "The engine loop")."""

import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxengine.engine.batch_builder import Shape
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.engine_setup import build_engine
from jaxengine.engine.interrupts import deferred_interrupts
from jaxengine.engine.mesh import Parallelism
from jaxengine.engine.outputs import RequestOutput
from jaxengine.engine.runner import ModelRunner
from jaxengine.engine.sampler import SampleOutput
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence import Sequence, Status
from jaxengine.engine.spec.acceptance import accept
from jaxengine.engine.step_executables import StoredStepFailed
from jaxengine.engine.step_timeline import StepTimeline
from jaxengine.host_memory import give_back_freed_memory


class LLMEngine:
    """Continuous batching over one model: `add_request`, then `step` until nothing is left."""

    def __init__(self, model: str | Path, config: EngineConfig, parallelism: Parallelism | None = None):
        """`parallelism`: where on the devices this engine runs (default: the config's, from
        the first device on; data-parallel replicas start further on)."""
        parts = build_engine(Path(model), config, parallelism)
        self.model_dir, self.config = Path(model), parts.config
        self.model_config, self.tokenizer, self.draft_config = parts.model_config, parts.tokenizer, parts.draft_config
        self.max_model_len = parts.max_model_len
        self.block_bytes, self.retention_interval = parts.plan.block_bytes, parts.plan.retention_interval
        self.builder, self.runner, self.scheduler = parts.builder, parts.runner, parts.scheduler
        self.spec = parts.spec  # speculative decoding, whole (`spec/`); None: the engine runs none of it
        self.inputs, self.outputs = parts.inputs, parts.outputs
        # Once nothing refers to the engine, the garbage collector gives back what the runner
        # holds, as `shutdown` does (the background compile holds the runner only weakly).
        self._release = weakref.finalize(self, _release_runner, self.runner)
        self.requests: dict[str, Sequence] = {}  # unfinished ones, by request id
        self._id_lock = threading.Lock()
        self.compile_seconds = 0.0
        self.peak_blocks_in_use = 0
        self.peak_slots_in_use = 0
        self.steps_in_larger_shapes = 0  # run in a larger shape while theirs compiled in the background
        # Shapes that have run a step: an executable's first run is several times slower than
        # its next ones, so the speculation gate does not time it.
        self._shapes_run: set[Shape] = set()
        self.timeline = StepTimeline()  # where each step's time goes (`step_timeline.py`)
        self._in_flight: _InFlight | None = None  # dispatched, tokens not read yet (async scheduling)
        self.steps_overlapped = 0  # dispatched while the step before ran
        # Dispatched with none in flight: the first after idling, those whose inputs needed the
        # step before read (grammars, bad words, speculation), all with async_scheduling off.
        self.steps_synchronous = 0
        self._next_id = 0
        self._last_end = 0.0  # perf_counter seconds: when the last step was processed

    # ------------------------------------------------------------------ step shapes

    def shapes(self) -> list[Shape]:
        """Every step shape this engine can run."""
        return self.builder.shapes()

    def warm_up(self, progress: Callable[[], None] | None = None) -> None:
        """Makes every step shape ready before the first request: loads those a previous run
        stored and compiles the rest — with `background_compile`, only the largest mixed and
        decode shapes now (every step fits one of them) and the others on a background
        thread, most sequences and decode shapes first."""
        start = time.perf_counter()
        shapes = sorted(
            self.shapes(), key=lambda s: (-s.num_seqs, not s.decode, -s.num_tokens, s.num_saves, s.sample_width)
        )
        largest = {max((s for s in shapes if s.decode == d), key=lambda s: s.size) for d in (False, True)}
        later = {s.key for s in shapes if s not in largest} if self.config.background_compile else set()
        batches = []
        for shape in shapes:
            batch, sampling = self.builder.empty(shape)
            batches.append((batch, sampling, shape.decode))
        self.runner.warm_up(batches, progress, later=later)
        self.compile_seconds += time.perf_counter() - start

    def _shape_for(self, scheduled: ScheduledStep) -> Shape:
        """The step's own shape, or while the background thread compiles it, the smallest
        ready shape the step fits."""
        shape = self.builder.shape_of(scheduled)
        ready = self.runner.steps.ready
        if shape.key in ready or not self.runner.steps.compiling:
            return shape
        fits = [s for s in self.shapes() if s.key in ready and s.covers(shape)]
        if not fits:
            return shape
        self.runner.steps.prefer(shape.key)
        self.steps_in_larger_shapes += 1
        return min(fits, key=lambda s: s.size)

    # ------------------------------------------------------------------ requests

    def validate_request(self, prompt: str | list[int], params: SamplingParams, where: str) -> list[int]:
        """The prompt's token ids, or a ValueError naming the request and the field."""
        self._check_open()
        return self.inputs.validate(prompt, params, where)

    def new_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        cache_salt: str | None = None,
        *,
        sample: int = 0,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> Sequence:
        """An already validated request, not queued yet (`enqueue`); safe from any thread.
        `request_id`: one given by a data-parallel front (ids unique across its replicas);
        else the next of this engine's."""
        if request_id is None:
            with self._id_lock:
                request_id = str(self._next_id)
                self._next_id += 1
        seq = self.inputs.sequence(
            request_id, token_ids, params, index, cache_salt, sample=sample, prompt=prompt, speculates=bool(self.spec)
        )
        self.requests[request_id] = seq
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Hands a new request to the scheduler (unless it was aborted meanwhile)."""
        if seq.status is Status.WAITING:
            self.scheduler.add(seq)

    def add_request(
        self, token_ids: list[int], params: SamplingParams, index: int = 0, cache_salt: str | None = None
    ) -> Sequence:
        """Queues an already validated request."""
        seq = self.new_request(token_ids, params, index, cache_salt)
        self.enqueue(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Stops a request now, with its prompt's other samples, and releases what they hold
        (finish reason "abort")."""
        for s in [seq, *seq.followers]:
            if s.status is not Status.FINISHED:
                s.finish_time = time.perf_counter()
            self.scheduler.abort(s)
            self.requests.pop(s.request_id, None)

    def output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of one prompt from its samples (sample 0 first)."""
        return self.outputs.output(samples)

    def decode(self, seq: Sequence) -> str:
        """A sample's output text so far, cut at a matched stop string."""
        return self.outputs.decode(seq)

    @property
    def has_unfinished(self) -> bool:
        """Whether a request is unfinished. (A step may still be in flight for sequences that
        ended in the step before it: its tokens are dropped whenever it is read, by the next
        step or `drain`.)"""
        return self.scheduler.has_unfinished

    def drain(self) -> None:
        """Reads and processes the step in flight, if any: none is left running."""
        if self._in_flight is not None:
            step, self._in_flight = self._in_flight, None
            self._complete(step)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page and checkpoint (with no request in flight)."""
        self.drain()
        self.scheduler.cache.clear()

    # ------------------------------------------------------------------ many hosts, release

    def follow(self) -> int:
        """On a process other than 0 of several (`multihost.py`): runs process 0's steps on this
        process's shards until process 0 stops them (`stop_followers`); returns how many ran."""
        return self.runner.lockstep.follow(self.runner)

    def stop_followers(self) -> None:
        """On process 0 of several: tells the other processes there are no more steps."""
        self.runner.lockstep.stop()

    @property
    def closed(self) -> bool:
        """Whether the engine has given back what it held (`shutdown`)."""
        return not self._release.alive

    def shutdown(self) -> None:
        """Aborts the requests in flight and gives back what the engine holds: its step
        executables, its background compile (stopped after the compile in flight), its pools
        and parameters. Later requests are refused."""
        for seq in list(self.requests.values()):
            self.abort(seq)
        self._in_flight = None
        self._release()  # once: a finalizer runs at most once

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine was shut down (shutdown()); create another to serve requests")

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Sequence]:
        """Runs one step; returns the sequences that received a token (finished ones included).

        All or nothing for the engine: Ctrl-C is held back until the step is done, and if the
        step raises (an error on the device, a bug), the pools are valid again and the
        scheduler consistent before the exception goes on: running sequences go back to the
        queue to be recomputed, and if the pools were lost the cache forgets their content.
        Which requests to abort is the caller's business (`abort`)."""
        self._check_open()
        with deferred_interrupts():
            try:
                return self._step()
            except BaseException as err:
                self._in_flight = None  # its tokens are lost with the pools: recomputed
                lost = self.runner.pools_lost()
                if lost:
                    self.runner.reset_pools()
                self.scheduler.recover(device_state_lost=lost)
                if isinstance(err, StoredStepFailed):  # compiled again: the sequences go on
                    return []
                raise

    def _step(self) -> list[Sequence]:
        """Dispatches the next step, then processes the one in flight before it (if any): the
        device runs step N + 1 while the host reads and processes step N's tokens, and the
        tokens N sampled reach N + 1 on the device (`SamplingBatch.feed_rows`). A step whose
        inputs need those tokens on the host (grammars, bad words, drafts a speculating
        sequence may offer) waits for them instead, as does every step with async_scheduling
        off; a step that verifies drafts, or in which a sequence speculates with a drafter, is
        read before the next is built (`Speculator.overlaps`)."""
        prev, self._in_flight = self._in_flight, None
        if prev is not None:
            prev.note_if_ready()
        updated, read_first = [], prev is not None and self._needs_read(prev)
        if read_first:
            updated, prev = self._complete(prev), None
        nxt = self._dispatch(prev) if self.scheduler.has_unfinished else None
        if nxt is None and prev is None and not read_first:
            raise RuntimeError("nothing could be scheduled although requests are pending")
        if nxt is not None and prev is not None:
            self.steps_overlapped += 1
        elif nxt is not None:
            self.steps_synchronous += 1
        if prev is not None:
            updated += self._complete(prev)
        if nxt is not None and nxt.early and self.config.async_scheduling:
            self._in_flight = nxt  # read by the next call, after it dispatches the step after
        elif nxt is not None:
            updated += self._complete(nxt)
        return updated

    def _needs_read(self, prev: "_InFlight") -> bool:
        """Whether building the next step needs the host to read `prev`'s tokens first: a
        sequence with a token not read yet whose next draw depends on it on the host (its
        grammar's mask, its bad words, the drafts it may offer when it speculates)."""
        pending = [seq for seq, sampled in zip(prev.scheduled.seqs, prev.samples) if sampled]
        if any(seq.matcher is not None or seq.bad_word_ids for seq in pending):
            return True
        speculating = any(seq.speculates for seq in pending)
        return speculating and self.spec.needs_tokens(self.scheduler.running)

    def _dispatch(self, prev: "_InFlight | None") -> "_InFlight | None":
        """Schedules, builds and dispatches a step (None: nothing to schedule). In a step whose
        tokens may be read later (`Speculator.overlaps`), the bookkeeping that needs no sampled
        token (pages computed, checkpoints written) is done at once, and each sampling sequence
        counts a token not read yet (`Sequence.num_unfilled`)."""
        step_start = time.perf_counter()
        if self.spec is not None:
            self.spec.before_step(self.scheduler.running)  # what each sequence offers to verify
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            return None
        self._note_pool_use()
        shape = self._shape_for(scheduled)
        drafting_next = self.spec is not None and self.spec.drafts_next(
            scheduled.seqs, shape.num_seqs, shape.runs_drafter
        )
        batch, sampling = self.builder.build(scheduled, shape, drafting=drafting_next)
        if prev is not None:
            prev.note_if_ready()
        start = time.perf_counter()
        out = self.runner.sample(batch, sampling, decode=shape.decode)
        dispatched = time.perf_counter()
        starts = [seq.num_computed for seq in scheduled.seqs]
        samples = [
            seq.finish_reason is None and seq.num_computed + n - len(scheduled.drafts_of(i)) >= seq.num_tokens
            for i, (seq, n) in enumerate(zip(scheduled.seqs, scheduled.num_tokens))
        ]  # else a prefill chunk that does not reach the end yet, or a completion step
        step = _InFlight(scheduled, shape, out, drafting_next, starts, samples, step_start, start, dispatched)
        if self.spec is None or self.spec.overlaps(scheduled):  # no drafts to accept on the host
            step.early = True
            self.scheduler.update(scheduled)
            for i, seq in enumerate(scheduled.seqs):
                if samples[i]:
                    seq.num_unfilled += 1
                    seq.feed_row = i
        return step

    def _complete(self, step: "_InFlight") -> list[Sequence]:
        """Reads a dispatched step's tokens and hands them to its sequences: acceptance of
        drafts, stops, logprobs, finishing; returns the sequences that received a token."""
        scheduled, out = step.scheduled, step.out
        # Every sequence of it ended before it was read: it ran after their ends (async), its
        # tokens are dropped, and it may have been read long after (when work came again).
        dropped = all(seq.status is Status.FINISHED for seq in scheduled.seqs)
        wait_start = time.perf_counter()
        tokens = np.asarray(out.tokens).tolist()  # [S][W]: a sequence's sample rows are its last W tokens
        ready = step.ready_at or time.perf_counter()
        if any(s.params.prompt_logprobs is not None for s in scheduled.seqs):
            self.outputs.record_prompt_logprobs(scheduled, out.prompt, step.starts)
        logprobs = None
        if any(s.params.logprobs is not None for s in scheduled.seqs):
            logprobs = [np.asarray(a) for a in (out.logprob, out.rank, out.top_ids, out.top_logprobs)]
        now = time.perf_counter()
        width = len(tokens[0])
        updated, finished = [], []
        kept = [0] * len(scheduled.seqs)  # drafts now computed, per sequence
        accepted: dict[int, int] = {}  # drafts the target agreed with, per sequence given tokens
        for i, seq in enumerate(scheduled.seqs):
            if not step.samples[i] or seq.status is Status.FINISHED:
                continue  # no token this step, or one drawn after its end (an overlapped step)
            drafts = scheduled.drafts_of(i)
            first_row = width - 1 - len(drafts)  # the row after its pending token
            emitted = accept(drafts, tokens[i][first_row:])
            accepted[i] = len(emitted) - 1
            if step.early:
                seq.num_unfilled -= 1
            for row, token in enumerate(emitted, start=first_row):
                self.outputs.append(seq, token, [a[i, row] for a in logprobs] if logprobs else None)
                if seq.finish_reason is not None:
                    break  # tokens past a stop are dropped
            kept[i] = row - first_row  # drafts now computed; the last token appended is the pending one
            if step.early:
                self.scheduler.filled(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.scheduler.add_front([f for f in seq.followers if f.status is Status.WAITING])
            if seq.finish_reason is not None:
                finished.append(seq)
            updated.append(seq)
        if not step.early:
            self.scheduler.update(scheduled, kept)
        for seq in finished:
            seq.finish_time = now
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        first_run = step.shape not in self._shapes_run
        self._shapes_run.add(step.shape)
        end = time.perf_counter()
        # What the step cost the loop: from its scheduling, or when overlapped from the end of
        # the step before (its scheduling ran while that one was on the device).
        step_seconds = end - max(step.step_start, self._last_end)
        self._last_end = end
        if first_run or dropped:  # a compile, or an executable's slower first run: not a step's time
            self.timeline.pause()
        else:
            self.timeline.record(step.step_start, step.dispatch_start, step.dispatched, wait_start, ready, end)
        if not self.has_unfinished:
            self.timeline.pause()
        if self.spec is not None:  # what the step showed
            self.spec.after_step(
                scheduled,
                accepted=accepted,
                kept=kept,
                next_drafts=np.asarray(out.drafts) if step.drafting else None,
                device_seconds=ready - step.dispatch_start,
                step_seconds=None if first_run else step_seconds,
                shape=step.shape,
            )
        return updated

    def _note_pool_use(self) -> None:
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.scheduler.cache.pool.num_referenced)
        if self.scheduler.slots is not None:
            self.peak_slots_in_use = max(self.peak_slots_in_use, len(self.scheduler.slots.in_use))

    def stats(self) -> dict:
        """Prefix-cache, pool and speculation counters since start."""
        return {
            "prefix_caching": self.config.enable_prefix_caching,
            "prefix_cache_retention_interval": self.retention_interval,
            **self.scheduler.cache_report(self.block_bytes),
            "peak_blocks_in_use": self.peak_blocks_in_use,
            "peak_ssm_live_slots_in_use": self.peak_slots_in_use,
            "steps_in_larger_shapes": self.steps_in_larger_shapes,
            "steps_overlapped": self.steps_overlapped,
            "steps_synchronous": self.steps_synchronous,
            "step_shapes_not_ready": len(self.shapes()) - len(self.runner.steps.ready),
            **self.timeline.as_dict(),
            **(self.spec.stats.as_dict() if self.spec else {}),
        }

    # ------------------------------------------------------------------ prompt logits

    def prompt_logits(self, token_ids: list[int], chunk_sizes: list[int]) -> np.ndarray:
        """Every position's logits for one prompt, prefilled in steps of `chunk_sizes`.
        Must not run while requests are in flight (it borrows pages and slots)."""
        self.drain()
        if self.scheduler.has_unfinished:
            raise RuntimeError("prompt_logits cannot run while requests are in flight")
        seq = Sequence("prompt_logits", 0, list(token_ids), len(token_ids), SamplingParams(), 0)
        sched = self.scheduler
        if sched.slots is not None:
            seq.owned_slots = sched.slots.alloc(2)
            seq.read_slot = seq.owned_slots[0]
        rows = []
        try:
            for n in chunk_sizes:
                if not sched.grow_pages(seq, seq.num_computed + n):
                    raise ValueError(f"prompt of {len(token_ids)} tokens does not fit in the KV pool")
                shape = Shape(max(16, 1 << (n - 1).bit_length()), 1, decode=False)  # no saves
                batch, _ = self.builder.build(ScheduledStep([seq], [n]), shape)
                rows.append(np.asarray(self.runner.logits(batch, all_logits=True))[:n])
                seq.num_computed += n
                if seq.owned_slots:
                    seq.read_slot = seq.write_slot
        finally:
            sched.release(seq)
        return np.concatenate(rows)


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose tokens the host has not processed yet."""

    scheduled: ScheduledStep
    shape: Shape
    out: SampleOutput
    drafting: bool  # its sequences may verify drafts in the next step
    starts: list[int]  # per sequence: its tokens computed before the step
    samples: list[bool]  # per sequence: the step samples its next token
    step_start: float  # perf_counter seconds: scheduling began
    dispatch_start: float
    dispatched: float
    early: bool = False  # its bookkeeping was done at dispatch (no speculation): tokens not read counted
    ready_at: float | None = None  # when the host first saw its tokens ready, if before reading them

    def note_if_ready(self) -> None:
        """Notes the time if the device has finished the step (it idles from then on)."""
        if self.ready_at is None and self.out.tokens.is_ready():
            self.ready_at = time.perf_counter()


def _release_runner(runner: ModelRunner) -> None:
    """Gives back a runner's executables, device arrays and background compile, and the host
    memory they freed."""
    runner.close()
    give_back_freed_memory()
