"""The public entry point: `LLM(model=...)` with `generate`, `generate_stream` and `prompt_logits`."""

import collections
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from jaxengine.engine.engine_config import EngineConfig, check_engine_keys
from jaxengine.engine.interrupts import deferred_interrupts
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput, StreamOutput
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Sequence as EngineSequence
from jaxengine.engine.sequence import Status

# A prompt is text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids} that
# may also carry a "cache_salt": requests with different salts never share cached prefixes.
Prompt = str | Sequence[int] | dict


class LLM:
    """Loads a model directory and serves prompts with continuous batching.

    Keyword arguments are the fields of `EngineConfig` (vLLM's names): `max_model_len`,
    `max_num_seqs`, `max_num_batched_tokens`, `page_size`, `num_cache_blocks` or
    `kv_cache_memory_bytes`, `prefix_cache_retention_interval`, `compilation_cache_dir`,
    `warm_up`, `background_compile`, ...

    What a caller can rely on:
      * every `generate` / `generate_stream` call owns its requests; several threads may call
        at once: whichever holds the engine's lock runs the next step for all of them, so
        their requests are batched together, and each call gets exactly its own outputs;
      * a call that raises (Ctrl-C included) aborts its own requests and leaves the engine
        usable; other calls' requests go on (recomputed if a failed step lost the pools);
      * a stream that is closed, or dropped without being read to the end, aborts the
        requests it has not finished; `abort(request_id)` stops one request."""

    def __init__(self, model: str | Path, dtype: str = "float32", **engine_args):
        check_engine_keys(sorted(engine_args))
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._lock = threading.RLock()
        self._stepping = False  # a step is running (under the lock)
        self._dropped: collections.deque[list[EngineSequence]] = collections.deque()  # by dropped streams
        self._inbox: collections.deque[EngineSequence] = collections.deque()  # submitted, not queued yet
        if self.engine.config.warm_up:
            self.warm_up()

    def warm_up(self, progress: bool = True) -> None:
        """Makes every step shape ready (see `LLMEngine.warm_up`), so no step waits for a compile."""
        shapes = self.engine.shapes()
        with self._lock, tqdm(total=len(shapes), desc="compiling step shapes", leave=False, disable=not progress) as bar:
            self.engine.warm_up(bar.update)

    def _submit(self, prompts: Sequence[Prompt], sampling_params) -> list[EngineSequence]:
        """Validates every request first, so a bad one rejects the call before any work."""
        if isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            raise ValueError("prompts must be a list of prompts (each a string, a list of token ids or a dict)")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            text_or_ids, salt = _unpack(prompt, f"request {i}")
            requests.append((self.engine.validate_request(text_or_ids, sp, f"request {i}"), sp, salt))
        # Into the inbox, not the scheduler: a step in flight (under the lock) must not wait for
        # this, and the next step takes them in, together with other callers' requests.
        seqs = [self.engine.new_request(ids, sp, i, salt) for i, (ids, sp, salt) in enumerate(requests)]
        self._inbox.extend(seqs)
        return seqs

    def _step_until(self, done) -> None:
        """Runs engine steps, for every caller's requests, until `done()` holds. `done` reads
        request statuses, which only change under the lock: checked first without it, so a
        caller whose requests finished returns at once instead of queueing for the lock."""
        while True:
            if done():
                return
            with self._lock, deferred_interrupts():
                while self._inbox:
                    self.engine.enqueue(self._inbox.popleft())
                while self._dropped:
                    self._abort(self._dropped.popleft())
                if done():
                    return
                self._stepping = True
                try:
                    self.engine.step()
                finally:
                    self._stepping = False
            time.sleep(0)  # let waiting callers run: they may have news, or requests to add

    def _abort(self, seqs: list[EngineSequence]) -> None:
        with self._lock, deferred_interrupts():
            for seq in seqs:
                self.engine.abort(seq)

    def _abort_soon(self, seqs: list[EngineSequence]) -> None:
        """Aborts now if no step is running and the lock is free, else at the next step (for
        the garbage collector, which may run anywhere, even inside a step)."""
        if self._lock.acquire(blocking=False):
            try:
                if not self._stepping:
                    while self._dropped:
                        self._abort(self._dropped.popleft())
                    self._abort(seqs)
                    return
            finally:
                self._lock.release()
        self._dropped.append(seqs)

    def abort(self, request_id: str) -> bool:
        """Stops an unfinished request (its output gets finish reason "abort"); False if no
        request of that id is unfinished."""
        with self._lock:
            seq = self.engine.requests.get(str(request_id))
            if seq is None or seq.status is Status.FINISHED:
                return False
            self.engine.abort(seq)
            return True

    def stats(self) -> dict:
        """Prefix-cache counters (tokens hit / asked, evictions, bytes held) and pool use."""
        with self._lock:
            return self.engine.stats()

    def generate(
        self,
        prompts: Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt (text or token ids); outputs in input order."""
        seqs = self._submit(prompts, sampling_params)
        with tqdm(total=len(seqs), desc="requests", disable=not use_tqdm or len(seqs) < 2) as bar:

            def done() -> bool:
                finished = sum(s.status is Status.FINISHED for s in seqs)
                bar.update(finished - bar.n)
                return finished == len(seqs)

            try:
                self._step_until(done)
            except BaseException:
                self._abort(seqs)
                raise
        return [self.engine.output(s) for s in seqs]

    def generate_stream(
        self, prompts: Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> "RequestStream":
        """Yields each request's new tokens and text as soon as a step produces them. The
        requests are validated and queued now; see `RequestStream`."""
        return RequestStream(self, self._submit(prompts, sampling_params))

    def prompt_logits(self, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None):
        """Logits after every prompt token, `[len, vocab]` float32, via the paged prefill path.

        `chunk_sizes` splits the prefill into steps of those sizes (they must sum to the
        prompt length); by default steps of at most `max_num_batched_tokens`."""
        ids = self.engine.validate_request(list(token_ids), SamplingParams(max_tokens=1), "prompt")
        if chunk_sizes is None:
            step = self.engine.config.max_num_batched_tokens
            chunk_sizes = [min(step, len(ids) - s) for s in range(0, len(ids), step)]
        chunk_sizes = list(chunk_sizes)
        if sum(chunk_sizes) != len(ids) or min(chunk_sizes) < 1:
            raise ValueError(f"chunk_sizes must be positive and sum to the prompt length {len(ids)}, got {chunk_sizes}")
        with self._lock:
            return self.engine.prompt_logits(ids, chunk_sizes)


class RequestStream:
    """The increments of one `generate_stream` call, in the order steps produce them.

    Iterating runs engine steps (for every caller's requests) while none of its own has
    news. `close()` — or dropping the stream unread — aborts its unfinished requests."""

    def __init__(self, llm: LLM, seqs: list[EngineSequence]):
        self._llm = llm
        self._seqs = seqs
        self._sent_tokens = [0] * len(seqs)
        self._sent_text = [""] * len(seqs)
        self._reported = [False] * len(seqs)
        self._closed = False

    def __iter__(self) -> Iterator[StreamOutput]:
        return self

    def __next__(self) -> StreamOutput:
        if self._closed:
            raise StopIteration
        event = None

        def ready() -> bool:
            nonlocal event
            event = self._next_event()
            return event is not None or all(self._reported)

        try:
            self._llm._step_until(ready)
        except BaseException:
            self.close()
            raise
        if event is None:
            self._closed = True
            raise StopIteration
        return event

    def _next_event(self) -> StreamOutput | None:
        engine = self._llm.engine
        for i, seq in enumerate(self._seqs):
            if self._reported[i]:
                continue
            finished = seq.status is Status.FINISHED
            new_tokens = seq.output_token_ids[self._sent_tokens[i] :]
            if not new_tokens and not finished:
                continue
            text = engine.decode(seq)
            sent = self._sent_text[i]
            self._sent_tokens[i] += len(new_tokens)
            self._sent_text[i] = text
            self._reported[i] = finished
            output = engine.output(seq) if finished else None
            return StreamOutput(i, seq.request_id, new_tokens, text[len(sent) :] if text.startswith(sent) else text,
                                finished, output)
        return None

    def close(self) -> None:
        """Aborts the requests not finished yet; the stream ends."""
        if self._closed:
            return
        self._closed = True
        self._llm._abort([s for s in self._seqs if s.status is not Status.FINISHED])

    def __del__(self) -> None:
        if not self._closed:
            self._closed = True
            self._llm._abort_soon([s for s in self._seqs if s.status is not Status.FINISHED])


def _unpack(prompt: Prompt, where: str) -> tuple[str | Sequence[int], str | None]:
    """(text or token ids, cache salt) of one prompt."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"})
    if unknown:
        raise ValueError(f"{where}: unknown prompt key {unknown[0]!r}; known: prompt, prompt_token_ids, cache_salt")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError(f"{where}: give exactly one of 'prompt' or 'prompt_token_ids'")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{where}: cache_salt must be a string, got {salt!r}")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), salt
