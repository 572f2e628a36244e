"""The public entry point: `LLM(model=...)` with `generate`, `chat`, `generate_stream` and
`prompt_logits` (vLLM's offline API, plus jaxengine's streaming and logits)."""

import atexit
import collections
import json
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxengine.engine import vllm_args
from jaxengine.engine.caller_lock import CallerLock
from jaxengine.engine.data_parallel import DataParallelEngine
from jaxengine.engine.engine_config import EngineConfig, check_engine_keys
from jaxengine.engine.increments import Increments
from jaxengine.engine.interrupts import deferred_interrupts
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput, StreamOutput
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Sequence as EngineSequence
from jaxengine.engine.sequence import Status

# A prompt is text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids}
# (`jaxengine.inputs`) that may also carry a "cache_salt": requests with different salts
# never share cached prefixes.
Prompt = str | Sequence[int] | dict

# generation_config.json keys vLLM takes its default sampling parameters from.
GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class LLM:
    """Loads a model directory and serves prompts with continuous batching.

    Keyword arguments are the fields of `EngineConfig` (vLLM's names): `max_model_len`,
    `max_num_seqs`, `max_num_batched_tokens`, `page_size`, `num_cache_blocks`,
    `kv_cache_memory_bytes` or `gpu_memory_utilization`, `tokenizer`, `seed`,
    `prefix_cache_retention_interval`, `compilation_cache_dir`, `warm_up`,
    `background_compile`, `speculative_config`, ...; and vLLM's `block_size`,
    `enforce_eager` and the others in `vllm_args.py`.

    What a caller can rely on:
      * every `generate` / `generate_stream` call owns its requests; several threads may call
        at once: whichever holds the engine's lock runs the next step for all of them, so
        their requests are batched together, and each call gets exactly its own outputs;
      * a call that raises (Ctrl-C included) aborts its own requests and leaves the engine
        usable; other calls' requests go on (recomputed if a failed step lost the pools);
      * a stream that is closed, or dropped without being read to the end, aborts the
        requests it has not finished; `abort(request_id)` stops one request."""

    def __init__(self, model: str | Path, dtype: str = "auto", **engine_args):
        engine_args = vllm_args.translate({"dtype": dtype, **engine_args})
        check_engine_keys(sorted(engine_args))
        config = EngineConfig(**engine_args)
        self.engine = LLMEngine(model, config) if config.data_parallel_size == 1 else DataParallelEngine(model, config)
        self.tokenizer = self.engine.tokenizer
        path = self.engine.model_dir / "generation_config.json"
        generation = json.loads(path.read_text()) if path.is_file() else {}
        self._sampling_defaults = {
            ours: generation[theirs]
            for theirs, ours in GENERATION_DEFAULTS.items()
            if generation.get(theirs) is not None
        }
        self.max_model_len = self.engine.max_model_len
        self._lock = CallerLock()
        self._stepping = False  # a step is running (under the lock)
        self._dropped: collections.deque[list[EngineSequence]] = collections.deque()  # by dropped streams
        self._inbox: collections.deque[EngineSequence] = collections.deque()  # submitted, not queued yet
        # Several processes (num_nodes, `multihost.py`): process 0 takes the requests and, when
        # it exits, releases the others, which run its steps meanwhile (`follow`).
        self.following = jax.process_index() > 0
        if jax.process_count() > 1 and not self.following:
            atexit.register(self.engine.stop_followers)
        if self.engine.config.warm_up:
            self.warm_up()

    def shutdown(self) -> None:
        """Aborts the requests in flight and gives back what the engine holds: its compiled
        steps (a bounded few stay shared with later engines of equal settings, `step_store`),
        its device pools and parameters, its background compile. The LLM serves no more
        requests after. `with LLM(...) as llm:` does the same, and so does the garbage collector
        once nothing refers to the engine (`del llm`; `gc.collect()` has it at once)."""
        with self._lock:
            self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def warm_up(self, progress: bool = True) -> None:
        """Makes every step shape ready (see `LLMEngine.warm_up`), so no step waits for a compile."""
        shapes = self.engine.shapes()
        with (
            self._lock,
            tqdm(total=len(shapes), desc="compiling step shapes", leave=False, disable=not progress) as bar,
        ):
            self.engine.warm_up(bar.update)

    def follow(self) -> int:
        """On a process other than 0 of a multi-host engine: runs process 0's steps until
        process 0's LLM is done (it exits); returns how many ran (0 once done). `generate`,
        `chat`, `generate_stream` and `prompt_logits` do this there and return no outputs,
        so one script serves on every host."""
        with self._lock:
            return self.engine.follow()

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (None for a model directory without one)."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling params: the model's
        generation_config.json settings that vLLM reads (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), else vLLM's defaults."""
        return SamplingParams(**self._sampling_defaults)

    def _submit(self, prompts, sampling_params, texts: list[str] | None = None) -> list[list[EngineSequence]]:
        """Validates every request first, so a bad one rejects the call before any work.
        Returns each prompt's samples; `texts` are the prompts' text where they came as ids.
        On a process other than 0 of several: none, after running process 0's steps."""
        if self.following:
            self.follow()
            return []
        if isinstance(prompts, (str, dict)) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]  # one prompt
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            text_or_ids, salt = _unpack(prompt, f"request {i}")
            text = text_or_ids if isinstance(text_or_ids, str) else texts[i] if texts else None
            requests.append((self.engine.validate_request(text_or_ids, sp, f"request {i}"), sp, salt, text))
        groups = []
        for i, (ids, sp, salt, text) in enumerate(requests):
            groups.append([self.engine.new_request(ids, sp, i, salt, sample=j, prompt=text) for j in range(sp.n)])
        # Into the inbox, not the scheduler: a step in flight (under the lock) must not wait for
        # this, and the next step takes them in, together with other callers' requests. With
        # prefix caching a prompt's later samples wait for its first to prefill it.
        for first, *others in groups:
            if others and self.engine.config.enable_prefix_caching:
                first.followers = others
                self._inbox.append(first)
            else:
                self._inbox.extend([first, *others])
        return groups

    def _step_until(self, done) -> None:
        """Runs engine steps, for every caller's requests, until `done()` holds. `done` reads
        request statuses, which only change under the lock: checked first without it, so a
        caller whose requests finished returns at once instead of queueing for the lock."""
        while not done():
            self.step_once(done)

    def step_once(self, done=None, after=None) -> None:
        """Takes in the requests submitted since the last step, then runs one engine step for
        every caller's requests, unless `done()` holds by then (without `done`: unless nothing
        is unfinished); `after()` runs once the step is done, still under the lock (to read
        its results)."""
        with self._lock, deferred_interrupts():
            while self._inbox:
                self.engine.enqueue(self._inbox.popleft())
            while self._dropped:
                self._abort(self._dropped.popleft())
            if (not done()) if done is not None else self.engine.has_unfinished:
                self._stepping = True
                try:
                    self.engine.step()
                finally:
                    self._stepping = False
            if after is not None:
                after()
        if self._lock.contended:
            time.sleep(0)  # let a caller waiting for the lock in

    @property
    def has_work(self) -> bool:
        """Whether a request is submitted or unfinished (one more step would do something)."""
        return bool(self._inbox) or bool(self._dropped) or self.engine.has_unfinished

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
            self.engine.abort(seq)  # and the prompt's other samples
            return True

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page and checkpoint; False (nothing done) while requests are
        in flight, as in vLLM."""
        with self._lock:
            if self.engine.has_unfinished or self._inbox:
                return False
            self.engine.reset_prefix_cache()
            return True

    def start_profile(self) -> None:
        """Starts a JAX profiler trace (TensorBoard / Perfetto) into the directory named by
        $JAXENGINE_PROFILER_DIR, or by vLLM's $VLLM_TORCH_PROFILER_DIR."""
        directory = os.environ.get("JAXENGINE_PROFILER_DIR") or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        if not directory:
            raise RuntimeError(
                "LLM.start_profile needs JAXENGINE_PROFILER_DIR (or VLLM_TORCH_PROFILER_DIR) set "
                "to the directory for the trace"
            )
        jax.profiler.start_trace(directory)

    def stop_profile(self) -> None:
        """Ends the trace `start_profile` began and writes it."""
        jax.profiler.stop_trace()

    def stats(self) -> dict:
        """Prefix-cache counters (tokens hit / asked, evictions, bytes held) and pool use."""
        with self._lock:
            return self.engine.stats()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates `n` completions for each prompt (text, token ids or a prompt dict; one or
        a list); outputs in input order. Without sampling params: `get_default_sampling_params()`."""
        return self._generate(self._submit(prompts, sampling_params), use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or
        a list of them, rendered with the tokenizer's chat template (or `chat_template`, a
        Jinja string or a file holding one) through transformers' `apply_chat_template`."""
        if self.tokenizer is None:
            raise ValueError(f"LLM.chat needs a tokenizer; {self.engine.model_dir} has no tokenizer.json")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if chat_template is not None and Path(chat_template).is_file():
            chat_template = Path(chat_template).read_text()
        if chat_template is None and self.tokenizer.chat_template is None:
            raise ValueError(
                f"LLM.chat: the tokenizer of {self.engine.model_dir} has no chat template "
                f"(tokenizer_config.json or chat_template.jinja); pass chat_template="
            )
        texts = [
            self.tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for conversation in conversations
        ]
        # The template writes any special tokens itself: tokenized without adding more.
        ids = [{"prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts]
        return self._generate(self._submit(ids, sampling_params, texts=texts), use_tqdm)

    def _generate(self, groups: list[list[EngineSequence]], use_tqdm: bool) -> list[RequestOutput]:
        seqs = [s for group in groups for s in group]
        with tqdm(total=len(groups), desc="requests", disable=not use_tqdm or len(groups) < 2) as bar:
            # Checked twice a step: only the first group not seen finished is looked at (a
            # finished request stays finished), so a step's cost does not grow with the number
            # of requests; the bar counts them all at most every tenth of a second.
            pending = collections.deque(groups)
            counted = 0.0  # when the bar last counted

            def done() -> bool:
                nonlocal counted
                while pending and _finished(pending[0]):
                    pending.popleft()
                if not bar.disable and (not pending or time.monotonic() - counted >= 0.1):
                    counted = time.monotonic()
                    bar.update(sum(map(_finished, groups)) - bar.n)
                return not pending

            try:
                self._step_until(done)
            except BaseException:
                self._abort(seqs)
                raise
        return [self.engine.output(group) for group in groups]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> "RequestStream":
        """Yields each request's new tokens and text as soon as a step produces them (one
        stream of increments per sample). The requests are validated and queued now; see
        `RequestStream`."""
        groups = self._submit(prompts, sampling_params)
        return RequestStream(self, [s for group in groups for s in group])

    def prompt_logits(self, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None):
        """Logits after every prompt token, `[len, vocab]` float32, via the paged prefill path.

        `chunk_sizes` splits the prefill into steps of those sizes (they must sum to the
        prompt length); by default steps of at most `max_num_batched_tokens`. On a process
        other than 0 of several: `[0, vocab]`, after running process 0's steps."""
        if self.following:
            self.follow()
            return np.zeros((0, self.engine.model_config.vocab_size), np.float32)
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
        self._increments = Increments(llm.engine, seqs)
        self._closed = False

    def __iter__(self) -> Iterator[StreamOutput]:
        return self

    def __next__(self) -> StreamOutput:
        if self._closed:
            raise StopIteration
        events = []

        def ready() -> bool:
            events.extend(self._increments.take(limit=1))
            return bool(events) or self._increments.done

        try:
            self._llm._step_until(ready)
        except BaseException:
            self.close()
            raise
        if not events:
            self._closed = True
            raise StopIteration
        return events[0]

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


def _finished(group: list[EngineSequence]) -> bool:
    """Whether every sample of a request has finished."""
    return all(s.status is Status.FINISHED for s in group)
