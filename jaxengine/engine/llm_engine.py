"""The engine loop: requests in, one scheduled and sampled step at a time, tokens out."""

import dataclasses
import logging
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.cache import checkpoint_policy
from jaxengine.cache.block_pool import BlockPool
from jaxengine.cache.hit_value import ModelCosts
from jaxengine.cache.live_slots import LiveSlots
from jaxengine.cache.prefix_cache import PrefixCache
from jaxengine.engine import multihost
from jaxengine.engine.batch_builder import BatchBuilder, Shape
from jaxengine.engine.draft_model import load_draft
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.interrupts import deferred_interrupts
from jaxengine.engine.mesh import Parallelism
from jaxengine.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxengine.engine.pools import store_layout
from jaxengine.engine.runner import ModelRunner
from jaxengine.engine.sampler import PromptLogprobs
from jaxengine.engine.sampling_params import SamplingParams, is_int
from jaxengine.engine.scheduler import ScheduledStep, Scheduler
from jaxengine.engine.sequence import Sequence, Status
from jaxengine.engine.speculative import DRAFTS_IN_STEP, NgramIndex, SpecStats, SpeculationGate, accept
from jaxengine.engine.step_executables import ShapeKey, StoredStepFailed
from jaxengine.engine.step_store import StepStore
from jaxengine.engine.tokenizer import load_tokenizer
from jaxengine.host_memory import give_back_freed_memory
from jaxengine.models.arch import checkpoint_dtype, load_model_config
from jaxengine.models.config import ModelConfig
from jaxengine.models.kernels import kernel_ops
from jaxengine.models.loader import load_model
from jaxengine.models.mixer_state import state_bytes
from jaxengine.models.mixers import recurrent_states

logger = logging.getLogger("jaxengine")


class LLMEngine:
    """Continuous batching over one model: `add_request`, then `step` until nothing is left."""

    def __init__(self, model: str | Path, config: EngineConfig, parallelism: Parallelism | None = None):
        """`parallelism`: where on the devices this engine runs (default: the config's, from
        the first device on; data-parallel replicas start further on)."""
        config.validate()
        if config.num_nodes > 1:  # before anything touches a device
            multihost.join(
                config.distributed_init_addr, config.num_nodes, config.node_rank, config.distributed_timeout_s
            )
        self.model_dir = Path(model)
        if config.dtype == "auto":
            config = dataclasses.replace(config, dtype=checkpoint_dtype(self.model_dir))
        self.config = config
        # Interpreted kernels run host callbacks, which a stored executable must not hold. The
        # engine stores its steps itself (`step_store`) and leaves JAX's process-wide persistent
        # cache as the program set it: executables that cache loads behind the store's back, in a
        # process that has compiled others, failed on XLA:CPU ("NOT_FOUND: Function ... not found").
        cache_dir = None if config.kernels.startswith("pallas-interpret") else config.compilation_cache_dir
        kernel_ops(config.kernels)  # kernels this machine cannot run: an error now, not at the first step
        declared = load_model_config(self.model_dir)
        parallelism = parallelism or config.parallelism
        parallelism.validate(declared)
        if config.dtype == "float16" and declared.num_recurrent_layers:
            raise ValueError(
                "engine argument dtype='float16' is not supported for models with recurrent layers "
                "(their float32 states would not fit float16 checkpoints); use bfloat16 or float32"
            )
        self.speculative = spec = config.speculative()
        uses_mtp = spec is not None and spec.method == "mtp"
        # The model's step drafts for the next one (the MTP module or the draft model).
        self.drafts_in_step = spec is not None and spec.method in DRAFTS_IN_STEP
        if uses_mtp and not declared.mtp_layers:
            raise ValueError(
                f"engine argument speculative_config.method='mtp': {self.model_dir / 'config.json'} "
                f"declares no MTP module (mtp_num_hidden_layers; Nemotron-H: num_nextn_predict_layers)"
            )
        self.model_config, graphdef, params = load_model(
            self.model_dir, config.dtype, config.kernels, mtp=uses_mtp, place=parallelism.placement(declared)
        )
        self.tokenizer = load_tokenizer(Path(config.tokenizer) if config.tokenizer else self.model_dir)
        cfg = self.model_config
        self.max_model_len = config.resolved_max_model_len(cfg)
        if cfg.num_attention_layers and self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"engine argument max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={cfg.max_position_embeddings} ({self.model_dir / 'config.json'})"
            )
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft(
                spec.model,
                cfg,
                dtype=config.dtype,
                kernels=config.kernels,
                max_model_len=self.max_model_len,
                parallelism=parallelism,
            )
        self.draft_config = draft[0] if draft else None
        if config.max_logprobs > cfg.vocab_size:
            raise ValueError(
                f"engine argument max_logprobs={config.max_logprobs} exceeds the vocabulary ({cfg.vocab_size})"
            )
        caching = config.enable_prefix_caching
        dtype = jax.tree.leaves(params)[0].dtype
        # A checkpoint spans the blocks the target's state needs, or the draft model's if more.
        layouts = [store_layout(c, config.page_size, dtype) for c in (cfg, self.draft_config) if c is not None]
        blocks_per_checkpoint = max((layout.blocks_per_checkpoint for layout in layouts if layout), default=0)
        self.block_bytes = config.block_bytes(cfg, self.draft_config)
        self.retention_interval, why = config.resolved_retention_interval(cfg)
        if config.gpu_memory_utilization is not None:
            self.config = config = dataclasses.replace(
                config, gpu_memory_utilization=None, kv_cache_memory_bytes=self._device_pool_bytes(cfg)
            )
        num_blocks = config.resolved_num_cache_blocks(cfg, blocks_per_checkpoint if caching else 0, self.draft_config)
        cache = PrefixCache(
            BlockPool(num_blocks),
            page_size=config.page_size,
            has_kv=bool(cfg.num_attention_layers),
            checkpoint_blocks=blocks_per_checkpoint,
            value=self._costs(cfg, [params, draft[2] if draft else None], blocks_per_checkpoint).value_fn(),
            enabled=caching,
        )
        k = self.speculative.num_speculative_tokens if self.speculative else 0
        self.spec_stats = SpecStats(k) if self.speculative else None
        # Whether this step drafts: always, or with `adaptive` (the default) while it pays.
        self.gate = SpeculationGate() if self.speculative and self.speculative.adaptive else None
        self.drafting = self.speculative is not None
        # ngram's proposer: (sequence, at most) -> drafts.
        self.draft: Callable[[Sequence, int], list[int]] = self._ngram_draft
        slots = LiveSlots(config.resolved_num_ssm_slots()) if cfg.num_recurrent_layers else None
        if slots is not None and slots.num_live < 2 + k:
            raise ValueError(
                f"engine argument num_ssm_slots={slots.num_live} is below the {2 + k} slots one sequence "
                f"needs (its read and write slots and one per speculative token)"
            )
        self.runner = ModelRunner(
            cfg,
            graphdef,
            params,
            num_blocks=num_blocks,
            page_size=config.page_size,
            num_slots=slots.num_slots if slots else 2,
            num_logprobs=config.max_logprobs,
            num_step_drafts=k if self.drafts_in_step else 0,
            draft=draft,
            # Several processes: steps compiled each (a stored one holds its process's devices).
            store=StepStore(cache_dir if jax.process_count() == 1 else None),
            kernels=config.kernels,
            parallelism=parallelism,
        )
        # Once nothing refers to the engine, the garbage collector gives back what the runner
        # holds, as `shutdown` does (the background compile holds the runner only weakly).
        self._release = weakref.finalize(self, _release_runner, self.runner)
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            page_size=config.page_size,
            cache=cache,
            slots=slots,
            retention_interval=self.retention_interval,
            propose=self._propose if self.speculative else None,
            num_speculative_tokens=k,
            speculates=self._admits if self.speculative else None,
        )
        self.builder = BatchBuilder(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=config.page_size,
            eos_token_ids=cfg.eos_token_ids,
            vocab_size=cfg.vocab_size,
            blocks_per_checkpoint=blocks_per_checkpoint if caching else 0,  # no hits to read without caching
            saves_checkpoints=caching and blocks_per_checkpoint > 0,
            num_speculative_tokens=k,
            recurrent=bool(cfg.num_recurrent_layers),
            drafter=self.drafts_in_step,
        )
        if caching and cfg.num_recurrent_layers:
            logger.info(
                "prefix cache: retention %s (prefix_cache_retention_interval=%r, %s); one checkpoint = %d blocks "
                "of %d bytes in a pool of %d blocks",
                checkpoint_policy.describe_interval(self.retention_interval),
                self.retention_interval,
                why,
                blocks_per_checkpoint,
                self.block_bytes,
                num_blocks,
            )
        self.requests: dict[str, Sequence] = {}  # unfinished ones, by request id
        self._id_lock = threading.Lock()
        self.compile_seconds = 0.0
        self.peak_blocks_in_use = 0
        self.peak_slots_in_use = 0
        self.steps_in_larger_shapes = 0  # run in a larger shape while theirs compiled in the background
        # Shapes that have run a step: an executable's first run is several times slower than
        # its next ones (5-8x on XLA:CPU), so the gate does not time it.
        self._shapes_run: set[Shape] = set()
        self._next_id = 0

    def _device_pool_bytes(self, cfg: ModelConfig) -> int | None:
        """Bytes for the cache pool under gpu_memory_utilization: that fraction of the device's
        memory, less what is in use (the weights) and the live state slots. None (the default
        sizing) on a device that reports no memory limit, as a CPU does."""
        stats = jax.devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            logger.info(
                "engine argument gpu_memory_utilization has no effect on %s (no device memory limit): "
                "the pool gets its default size",
                jax.devices()[0].platform,
            )
            return None
        slots = self.config.resolved_num_ssm_slots() if cfg.num_recurrent_layers else 0
        models = [m for m in (cfg, self.draft_config) if m is not None]
        dtype = jnp.dtype(self.config.dtype)
        slot_bytes = sum(state_bytes(arrays, dtype) for m in models for arrays in recurrent_states(m))
        budget = int(self.config.gpu_memory_utilization * stats["bytes_limit"]) - stats.get("bytes_in_use", 0)
        budget -= slots * slot_bytes
        budget = multihost.from_process_0(budget)  # pools of one shape on every process
        if budget < 2 * self.config.block_bytes(cfg, self.draft_config):
            raise ValueError(
                f"engine argument gpu_memory_utilization={self.config.gpu_memory_utilization} leaves "
                f"no room for the cache pool ({stats.get('bytes_in_use', 0)} bytes in use of "
                f"{stats['bytes_limit']})"
            )
        return budget

    def _costs(self, cfg: ModelConfig, params, blocks_per_checkpoint: int) -> ModelCosts:
        """What the prefix cache weighs hits by (`hit_value.py`); `params`: the target's and the
        draft model's (whose work a hit saves too)."""
        a = cfg.attention
        block_bytes = self.block_bytes
        return ModelCosts(
            num_weights=sum(x.size for x in jax.tree.leaves(params)),
            attention_width=cfg.num_attention_layers * a.num_heads * a.head_dim if a else 0,
            kv_bytes_per_token=block_bytes // self.config.page_size if cfg.num_attention_layers else 0,
            checkpoint_bytes=blocks_per_checkpoint * block_bytes,
        )

    # ------------------------------------------------------------------ set-up

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
        largest = {max((s for s in shapes if s.decode == d), key=_size) for d in (False, True)}
        later = {_key(s) for s in shapes if s not in largest} if self.config.background_compile else set()
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
        if _key(shape) in ready or not self.runner.steps.compiling:
            return shape
        fits = [s for s in self.shapes() if _key(s) in ready and _covers(s, shape)]
        if not fits:
            return shape
        self.runner.steps.prefer(_key(shape))
        self.steps_in_larger_shapes += 1
        return min(fits, key=_size)

    # ------------------------------------------------------------------ requests

    def validate_request(self, prompt: str | list[int], params: SamplingParams, where: str) -> list[int]:
        """The prompt's token ids, or a ValueError naming the request and the field."""
        self._check_open()
        cfg = self.model_config
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(where, vocab_size=cfg.vocab_size, max_logprobs=self.config.max_logprobs)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: text prompts need a tokenizer.json in {self.model_dir}")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            for k, t in enumerate(prompt):
                if not is_int(t):
                    raise ValueError(
                        f"{where}: token ids must be integers, got {t!r} ({type(t).__name__}) at index {k}"
                    )
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"{where}: a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len - 1 if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            ids = ids[-keep:]
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.bad_words needs a tokenizer.json in {self.model_dir}")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{where}: the prompt ({len(ids)} tokens) leaves no room for output within "
                f"max_model_len={self.max_model_len}"
            )
        total = len(ids) + self.max_output_tokens(len(ids), params)
        cache = self.scheduler.cache
        if cache.has_kv and -(-total // self.config.page_size) > cache.pool.num_usable:
            raise ValueError(f"{where}: needs {total} tokens of KV cache, more than the whole pool holds")
        return ids

    def max_output_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """`max_tokens`, capped (as vLLM caps it) where the output would pass max_model_len."""
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def _bad_word_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word as tokenized alone and, where that gives other tokens of the same
        count, after a space (a word mid-text), as vLLM tokenizes them."""
        words = []
        for word in params.bad_words or ():
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            words.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                words.append(spaced)
        return words

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
        It keeps its own copy of `params`, with max_tokens resolved and, for sample j of a
        seeded prompt, seed + j (as vLLM seeds its n samples). `request_id`: one given by a
        data-parallel front (ids unique across its replicas); else the next of this engine's."""
        if request_id is None:
            with self._id_lock:
                request_id = str(self._next_id)
                self._next_id += 1
        max_tokens = self.max_output_tokens(len(token_ids), params)
        params = dataclasses.replace(
            params,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            seed=None if params.seed is None else params.seed + sample,
        )
        seed = params.step_seed if params.seed is not None else zlib.crc32(f"{self.config.seed}/{request_id}".encode())
        seq = Sequence(
            request_id,
            index,
            list(token_ids),
            len(token_ids),
            params,
            seed,
            cache_salt=cache_salt,
            prompt=prompt,
            sample=sample,
            bad_word_ids=self._bad_word_ids(params),
        )
        self.requests[request_id] = seq
        return seq

    def enqueue(self, seq: Sequence) -> None:
        """Hands a new request to the scheduler (unless it was aborted meanwhile)."""
        if seq.status is Status.WAITING:
            self.scheduler.add(seq)

    def _release_followers(self, seq: Sequence) -> None:
        """Queues a prompt's other samples, first in line, once `seq` has prefilled it."""
        self.scheduler.add_front([f for f in seq.followers if f.status is Status.WAITING])

    def add_request(
        self, token_ids: list[int], params: SamplingParams, index: int = 0, cache_salt: str | None = None
    ) -> Sequence:
        """Queues an already validated request."""
        seq = self.new_request(token_ids, params, index, cache_salt)
        self.enqueue(seq)
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def follow(self) -> int:
        """On a process other than 0 of several (`multihost.py`): runs process 0's steps on this
        process's shards until process 0 stops them (`stop_followers`); returns how many ran."""
        return self.runner.lockstep.follow(self.runner)

    def stop_followers(self) -> None:
        """On process 0 of several: tells the other processes there are no more steps."""
        self.runner.lockstep.stop()

    def reset_prefix_cache(self) -> None:
        """Forgets every cached page and checkpoint (with no request in flight)."""
        self.scheduler.cache.clear()

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
                lost = self.runner.pools_lost()
                if lost:
                    self.runner.reset_pools()
                self.scheduler.recover(device_state_lost=lost)
                if isinstance(err, StoredStepFailed):  # compiled again: the sequences go on
                    return []
                raise

    def abort(self, seq: Sequence) -> None:
        """Stops a request now, with its prompt's other samples, and releases what they hold
        (finish reason "abort")."""
        for s in [seq, *seq.followers]:
            if s.status is not Status.FINISHED:
                s.finish_time = time.perf_counter()
            self.scheduler.abort(s)
            self.requests.pop(s.request_id, None)

    def _propose(self, seq: Sequence, at_most: int) -> list[int]:
        """Draft tokens for a sequence about to decode: at most `at_most`."""
        return seq.step_drafts[: self._draft_limit(seq, at_most)] if self.drafting else []

    def _draft_limit(self, seq: Sequence, at_most: int) -> int:
        """How many drafts a sequence may verify: at most `at_most`, none past its max_tokens
        or max_model_len, none with bad words (their bans depend on each drafted token)."""
        if seq.bad_word_ids:
            return 0
        return max(
            0,
            min(
                self.speculative.num_speculative_tokens,
                at_most,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - len(seq.tokens),
            ),
        )

    def _admits(self, num_seqs: int, hit_has_draft_state: bool) -> bool:
        """Whether a sequence admitted into a batch of `num_seqs` speculates: not where its
        prefix hit lacks the draft's state, and, for the methods that draft inside the step
        (the MTP module, a draft model) with the adaptive gate, only where speculation pays
        against plain decoding (their pass over every token is then saved). ngram is decided
        step by step only."""
        speculates = hit_has_draft_state and (
            self.gate is None or not self.drafts_in_step or self.gate.admits(self.builder.seq_bucket(num_seqs))
        )
        self.spec_stats.requests_speculating += speculates
        self.spec_stats.requests_not_speculating += not speculates
        return speculates

    def _may_draft_next(self, seqs: list[Sequence], num_seqs: int) -> bool:
        """Whether the next step may verify drafts (the MTP module or draft model then drafts
        in this one; not in a step the gate runs plain to time it)."""
        if self.gate is None:
            return self.drafting
        return not self.gate.retiming and self.gate.may_open_next(num_seqs, _share_speculating(seqs))

    def _open(self) -> None:
        """Decides whether this step drafts (`drafting`). ngram first proposes the drafts
        where the gate may open (so it decides on the share of sequences that have some)."""
        running = self.scheduler.running
        bucket = self.builder.seq_bucket(max(1, len(running)))
        share = _share_speculating(running)
        if not self.drafts_in_step and (self.gate is None or self.gate.may_open_next(bucket, share)):
            share = self._ngram_proposals(running) / max(1, len(running))
        if self.gate is not None:
            self.drafting = self.gate.open(bucket, share)

    def _ngram_proposals(self, running: list[Sequence]) -> int:
        """Sets each running sequence's drafts for this step (`step_drafts`, by prompt lookup;
        only a speculating sequence about to decode has some); how many have some."""
        start = time.perf_counter()
        for seq in running:
            limit = self._draft_limit(seq, self.speculative.num_speculative_tokens)
            seq.step_drafts = self.draft(seq, limit) if seq.speculates and seq.num_uncomputed == 1 and limit else []
        self.spec_stats.draft_seconds += time.perf_counter() - start
        return sum(1 for seq in running if seq.step_drafts)

    def _ngram_draft(self, seq: Sequence, limit: int) -> list[int]:
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.speculative.prompt_lookup_min, self.speculative.prompt_lookup_max)
        return seq.ngram_index.propose(seq.tokens, limit)

    def _step(self) -> list[Sequence]:
        step_start = time.perf_counter()
        if self.speculative is not None:
            self._open()
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            raise RuntimeError("nothing could be scheduled although requests are pending")
        self._note_pool_use()
        shape = self._shape_for(scheduled)
        drafting_next = shape.runs_drafter and self._may_draft_next(scheduled.seqs, shape.num_seqs)  # for the next
        batch, sampling = self.builder.build(scheduled, shape, drafting=drafting_next)
        start = time.perf_counter()
        out = self.runner.sample(batch, sampling, decode=shape.decode)
        tokens = np.asarray(out.tokens)  # [S, W]: a sequence's sample rows are its last W tokens
        seconds = time.perf_counter() - start
        if any(scheduled.drafts):
            self.spec_stats.verify_seconds += seconds
        if any(s.params.prompt_logprobs is not None for s in scheduled.seqs):
            self._record_prompt_logprobs(scheduled, out.prompt)
        want_logprobs = any(s.params.logprobs is not None for s in scheduled.seqs)
        if want_logprobs:
            chosen, top_lp, top_ids, ranks = (
                np.asarray(a) for a in (out.logprob, out.top_logprobs, out.top_ids, out.rank)
            )
        step_drafts = np.asarray(out.drafts) if drafting_next else None  # [S, k]: the MTP module's or draft model's
        now = time.perf_counter()
        width = tokens.shape[1]
        updated, finished, kept = [], [], []
        for i, seq in enumerate(scheduled.seqs):
            drafts = scheduled.drafts_of(i)
            kept.append(0)
            if (
                seq.num_computed + scheduled.num_tokens[i] - len(drafts) < len(seq.tokens)
                or seq.finish_reason is not None
            ):
                continue  # a prefill chunk that does not reach the end yet, or a completion step
            first_row = width - 1 - len(drafts)  # the row after its pending token
            emitted = accept(drafts, [int(t) for t in tokens[i, first_row:]])
            if drafts:
                self.spec_stats.record(len(drafts), len(emitted) - 1)
            for row, token in enumerate(emitted, start=first_row):
                seq.tokens.append(token)
                if seq.params.logprobs is not None:
                    top = zip(top_ids[i, row, : seq.params.logprobs], top_lp[i, row])
                    seq.logprobs.append(self._logprobs(seq, token, float(chosen[i, row]), int(ranks[i, row]), top))
                    seq.cumulative_logprob += float(chosen[i, row])
                self._check_finished(seq, token)
                if seq.finish_reason is not None:
                    break  # tokens past a stop are dropped
            kept[-1] = row - first_row  # drafts now computed; the last token appended is the pending one
            if self.drafts_in_step:
                seq.step_drafts = step_drafts[i].tolist() if drafting_next else []
            if seq.first_token_time is None:
                seq.first_token_time = now
                self._release_followers(seq)
            if seq.finish_reason is not None:
                finished.append(seq)
            updated.append(seq)
        self.scheduler.update(scheduled, kept)
        for seq in finished:
            seq.finish_time = now
            self.scheduler.finish(seq)
            self.requests.pop(seq.request_id, None)
        first_run = shape not in self._shapes_run
        self._shapes_run.add(shape)
        if self.gate is not None and shape.decode and not first_run:  # timed whole: the host's work differs too
            step_seconds = time.perf_counter() - step_start
            if shape.sample_width == 1 and not drafting_next:
                self.gate.record_decode(shape.num_seqs, step_seconds, plain=self._plain(scheduled))
            elif any(scheduled.drafts):
                drafting = sum(1 for d in scheduled.drafts if d)
                self.gate.record_verify(shape.num_seqs, step_seconds, 1 + sum(kept) / drafting)
        return updated

    def _plain(self, scheduled: ScheduledStep) -> bool:
        """Whether a step did none of the speculative method's own work (ngram has none; the
        MTP module and the draft model are not run in a step where no sequence speculates)."""
        return not self.drafts_in_step or not any(seq.speculates for seq in scheduled.seqs)

    def _record_prompt_logprobs(self, scheduled: ScheduledStep, prompt: PromptLogprobs) -> None:
        """Appends the Logprob entries of the prompt tokens this step's chunks predict (the
        tokens after the ones they compute), for the sequences that asked."""
        lp, rank, top_lp, top_ids = (
            np.asarray(a) for a in (prompt.logprob, prompt.rank, prompt.top_logprobs, prompt.top_ids)
        )
        offset = 0
        for seq, n in zip(scheduled.seqs, scheduled.num_tokens):
            k, start = seq.params.prompt_logprobs, seq.num_computed
            for q in range(start, min(start + n, seq.num_prompt_tokens - 1)) if k is not None else ():
                if len(seq.prompt_logprobs) == q + 1:  # else recorded before a preemption
                    t = offset + q - start
                    top = zip(top_ids[t, :k], top_lp[t, :k])
                    seq.prompt_logprobs.append(self._logprobs(seq, seq.tokens[q + 1], float(lp[t]), int(rank[t]), top))
            offset += n

    def _note_pool_use(self) -> None:
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.scheduler.cache.pool.num_referenced)
        if self.scheduler.slots is not None:
            self.peak_slots_in_use = max(self.peak_slots_in_use, len(self.scheduler.slots.in_use))

    def stats(self) -> dict:
        """Prefix-cache and pool counters since start."""
        sched = self.scheduler
        cache, slots = sched.cache, sched.slots
        asked = sched.stats.tokens_asked
        block_bytes = self.block_bytes
        c = cache.counters
        return {
            "prefix_caching": self.config.enable_prefix_caching,
            "prefix_cache_retention_interval": self.retention_interval,
            "tokens_asked": asked,
            "tokens_hit": sched.stats.tokens_hit,
            "hit_rate": sched.stats.tokens_hit / asked if asked else 0.0,
            "tokens_lost_for_want_of_checkpoint": sched.stats.tokens_lost,
            "cache_blocks": cache.pool.num_usable,
            "cache_block_bytes": block_bytes,
            "blocks_in_use": cache.pool.num_referenced,
            "kv_pages_cached": cache.num_page_blocks if cache.has_kv else 0,
            "kv_page_bytes_held": (cache.num_page_blocks if cache.has_kv else 0) * block_bytes,
            "checkpoints_held": len(cache.checkpoints),
            "checkpoint_bytes_held": cache.num_checkpoint_blocks * block_bytes,
            "kv_page_evictions": c.pages_evicted,
            "checkpoint_evictions": c.checkpoints_evicted,
            "checkpoints_written": c.checkpoints_written,
            "checkpoints_skipped": c.checkpoints_skipped,
            "ssm_live_slots_in_use": len(slots.in_use) if slots else 0,
            "preemptions": sched.num_preemptions,
            "peak_blocks_in_use": self.peak_blocks_in_use,
            "peak_ssm_live_slots_in_use": self.peak_slots_in_use,
            "steps_in_larger_shapes": self.steps_in_larger_shapes,
            "step_shapes_not_ready": len(self.shapes()) - len(self.runner.steps.ready),
            **(self.spec_stats.as_dict() if self.spec_stats else {}),
        }

    def _logprobs(self, seq: Sequence, token: int, logprob: float, rank: int, top) -> dict[int, Logprob]:
        """One position's Logprob entries: the chosen (or prompt) token first, then the top N."""
        entry = {token: Logprob(logprob, rank, self._token_text(seq, token))}
        for r, (t, lp) in enumerate(top, start=1):
            entry.setdefault(int(t), Logprob(float(lp), r, self._token_text(seq, int(t))))
        return entry

    def _token_text(self, seq: Sequence, token: int) -> str | None:
        if self.tokenizer is None or not seq.params.detokenize:
            return None
        return self.tokenizer.decode([token])

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
                return
            if not p.ignore_eos and token in self.model_config.eos_token_ids:
                seq.finish_reason = "stop"
                return
            if p.stop and self.tokenizer is not None:
                text = self._full_text(seq)
                found = [(at, s) for s in p.stop if (at := text.find(s)) >= 0]
                if found:
                    at, stop = min(found)
                    seq.stop_text_cut = at + len(stop) if p.include_stop_str_in_output else at
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    return
        if seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = "length"

    # ------------------------------------------------------------------ outputs

    def _full_text(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    def decode(self, seq: Sequence) -> str:
        """The output text so far, cut at a matched stop string ("" without detokenizing)."""
        if self.tokenizer is None or not seq.params.detokenize:
            return ""
        text = self._full_text(seq)
        return text if seq.stop_text_cut is None else text[: seq.stop_text_cut]

    def completion(self, seq: Sequence) -> CompletionOutput:
        """One sample's output so far."""
        metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions)
        wants_logprobs = seq.params.logprobs is not None
        return CompletionOutput(
            index=seq.sample,
            text=self.decode(seq) if self.tokenizer is not None else None,
            token_ids=seq.output_token_ids,
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
            logprobs=seq.logprobs if wants_logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            metrics=metrics,
        )

    def output(self, samples: list[Sequence]) -> RequestOutput:
        """The output of one prompt from its samples (sample 0 first)."""
        first = samples[0]
        outputs = [self.completion(s) for s in samples]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.tokens[: first.num_prompt_tokens],
            prompt_logprobs=first.prompt_logprobs if first.params.prompt_logprobs is not None else None,
            outputs=outputs,
            finished=all(s.status is Status.FINISHED for s in samples),
            num_cached_tokens=first.num_cached_tokens or 0,
            metrics=outputs[0].metrics,
        )

    # ------------------------------------------------------------------ prompt logits

    def prompt_logits(self, token_ids: list[int], chunk_sizes: list[int]) -> np.ndarray:
        """Every position's logits for one prompt, prefilled in steps of `chunk_sizes`.
        Must not run while requests are in flight (it borrows pages and slots)."""
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


def _key(shape: Shape) -> ShapeKey:
    """The runner's key of a shape's executable."""
    return shape.num_tokens, shape.num_seqs, shape.num_saves, shape.decode, shape.sample_width, shape.runs_drafter


def _size(shape: Shape) -> tuple[int, int, bool, int, int, int, bool]:
    return (
        shape.num_tokens,
        shape.num_seqs,
        not shape.decode,
        shape.num_saves,
        shape.sample_width,
        shape.num_position_states,
        shape.runs_drafter,
    )


def _covers(big: Shape, small: Shape) -> bool:
    """Whether a step of shape `small` fits `big`: no dimension smaller, and a decode step
    fits a mixed shape (a mixed step handles any tokens per sequence) but not the reverse (a
    verify shape is a decode shape with more tokens per sequence: a plain decode step fits it);
    a shape with the drafter fits a step without it (the drafter skips it at run time)."""
    return (
        big.num_tokens >= small.num_tokens
        and big.num_seqs >= small.num_seqs
        and big.num_saves >= small.num_saves
        and (big.decode == small.decode or not big.decode)
        and (not big.decode or big.num_tokens // big.num_seqs >= small.num_tokens // small.num_seqs)
        and big.sample_width >= small.sample_width
        and big.num_position_states >= small.num_position_states
        and big.runs_drafter >= small.runs_drafter
    )


def _share_speculating(seqs: list[Sequence]) -> float:
    """The share of `seqs` admitted to speculate."""
    return sum(1 for seq in seqs if seq.speculates) / max(1, len(seqs))


def _release_runner(runner: ModelRunner) -> None:
    """Gives back a runner's executables, device arrays and background compile, and the host
    memory they freed."""
    runner.close()
    give_back_freed_memory()
