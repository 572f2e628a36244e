"""The engine loop: requests in, one scheduled and sampled step at a time, tokens out."""

import time
import zlib
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxengine.cache.page_cache import PageCache
from jaxengine.cache.state_cache import Retention, StateCache
from jaxengine.engine.batch_builder import BatchBuilder, Shape, step_shapes
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.outputs import RequestMetrics, RequestOutput
from jaxengine.engine.runner import ModelRunner, enable_compilation_cache
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import ScheduledStep, Scheduler
from jaxengine.engine.sequence import Sequence
from jaxengine.engine.tokenizer import load_tokenizer
from jaxengine.models.config import ModelConfig
from jaxengine.models.loader import load_model


def prefix_flops(cfg: ModelConfig, num_params: int, num_tokens: int) -> float:
    """Forward FLOPs a prefix of `num_tokens` costs (what a hit on it saves): two per weight
    per token, plus attention's quadratic score and value products."""
    attn = 0
    if cfg.attention is not None:
        attn = 2 * cfg.num_attention_layers * cfg.attention.num_heads * cfg.attention.head_dim * num_tokens * num_tokens
    return 2.0 * num_params * num_tokens + attn


class LLMEngine:
    """Continuous batching over one model: `add_request`, then `step` until nothing is left."""

    def __init__(self, model: str | Path, config: EngineConfig):
        config.validate()
        self.config = config
        # Interpreted kernels run host callbacks, which a persistent cache must not store.
        if config.compilation_cache_dir and not config.kernels.startswith("pallas-interpret"):
            enable_compilation_cache(config.compilation_cache_dir)
        self.model_dir = Path(model)
        self.model_config, graphdef, params = load_model(self.model_dir, config.dtype, config.kernels)
        self.tokenizer = load_tokenizer(self.model_dir)
        cfg = self.model_config
        self.max_model_len = config.resolved_max_model_len(cfg)
        dtype_bytes = 4 if config.dtype == "float32" else 2
        caching = config.enable_prefix_caching
        num_params = sum(x.size for x in jax.tree.leaves(params))
        pages = states = retention = None
        if cfg.num_attention_layers:
            pages = PageCache(config.resolved_num_kv_pages(cfg, dtype_bytes), enabled=caching)
        if cfg.num_mamba_layers:
            interval = config.resolved_checkpoint_interval(cfg)
            retention = Retention.parse(config.ssm_retention, interval)
            states = StateCache(
                config.resolved_num_ssm_slots(),
                config.resolved_num_snapshots(cfg),
                flops_saved=lambda n: prefix_flops(cfg, num_params, n),
                alpha=config.ssm_eviction_alpha,
                enabled=caching,
            )
        self.runner = ModelRunner(
            cfg, graphdef, params,
            num_pages=pages.num_pages if pages else 2,
            page_size=config.page_size,
            num_slots=states.num_slots if states else 2,
            num_logprobs=config.max_logprobs,
        )
        self.scheduler = Scheduler(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            page_size=config.page_size,
            pages=pages,
            states=states,
            retention=retention,
            enable_prefix_caching=caching,
        )
        self.builder = BatchBuilder(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            page_size=config.page_size,
            eos_token_ids=cfg.eos_token_ids,
            checkpoint_every=retention.every if retention and caching else 0,
        )
        self.compile_seconds = 0.0
        self.peak_pages_in_use = 0
        self.peak_slots_in_use = 0
        self._next_id = 0

    # ------------------------------------------------------------------ set-up

    def shapes(self) -> list[Shape]:
        """Every step shape this engine can run."""
        return step_shapes(self.builder.token_buckets, self.builder.seq_buckets)

    def warm_up(self, progress: Callable[[], None] | None = None) -> None:
        """Compiles every step shape before the first request (from the persistent cache
        when a previous run left it there)."""
        start = time.perf_counter()
        batches = []
        for shape in self.shapes():
            batch, sampling = self.builder.empty(shape)
            batches.append((batch, sampling, shape.decode))
        self.runner.warm_up(batches, progress)
        self.compile_seconds += time.perf_counter() - start

    # ------------------------------------------------------------------ requests

    def validate_request(self, prompt: str | list[int], params: SamplingParams, where: str) -> list[int]:
        """The prompt's token ids, or a ValueError naming the request and the field."""
        cfg = self.model_config
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(where, vocab_size=cfg.vocab_size, max_logprobs=self.config.max_logprobs)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: text prompts need a tokenizer.json in {self.model_dir}")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt]
        else:
            raise ValueError(f"{where}: a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError(f"{where}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"{where}: prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len={self.max_model_len}"
            )
        pages = self.scheduler.pages
        if pages is not None and -(-total // self.config.page_size) > pages.num_usable:
            raise ValueError(f"{where}: needs {total} tokens of KV cache, more than the whole pool holds")
        return ids

    def add_request(
        self, token_ids: list[int], params: SamplingParams, index: int = 0, cache_salt: str | None = None
    ) -> Sequence:
        """Queues an already validated request."""
        request_id = str(self._next_id)
        self._next_id += 1
        seed = params.seed if params.seed is not None else zlib.crc32(f"{self.config.seed}/{request_id}".encode())
        seq = Sequence(request_id, index, list(token_ids), len(token_ids), params, seed, cache_salt=cache_salt)
        self.scheduler.add(seq)
        return seq

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[Sequence]:
        """Runs one step; returns the sequences that received a token (finished ones included)."""
        scheduled = self.scheduler.schedule()
        if not scheduled.seqs:
            raise RuntimeError("nothing could be scheduled although requests are pending")
        self._note_pool_use()
        shape = self.builder.shape_of(scheduled)
        batch, sampling = self.builder.build(scheduled, shape)
        out = self.runner.sample(batch, sampling, decode=shape.decode)
        tokens = np.asarray(out.tokens)
        want_logprobs = any(s.params.logprobs is not None for s in scheduled.seqs)
        if want_logprobs:
            chosen, top_lp, top_ids = (np.asarray(a) for a in (out.logprob, out.top_logprobs, out.top_ids))
        now = time.perf_counter()
        self.scheduler.update(scheduled)
        updated = []
        for i, seq in enumerate(scheduled.seqs):
            if seq.num_computed < len(seq.tokens):
                continue  # a prefill chunk that does not reach the end yet
            token = int(tokens[i])
            seq.tokens.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.params.logprobs is not None:
                entry = {int(t): float(lp) for t, lp in zip(top_ids[i, : seq.params.logprobs], top_lp[i])}
                entry[token] = float(chosen[i])
                seq.logprobs.append(entry)
            self._check_finished(seq, token)
            if seq.finish_reason is not None:
                seq.finish_time = now
                self.scheduler.finish(seq)
            updated.append(seq)
        return updated

    def _note_pool_use(self) -> None:
        if self.scheduler.pages is not None:
            self.peak_pages_in_use = max(self.peak_pages_in_use, self.scheduler.pages.num_in_use)
        if self.scheduler.states is not None:
            self.peak_slots_in_use = max(self.peak_slots_in_use, len(self.scheduler.states.live))

    def stats(self) -> dict:
        """Prefix-cache and pool counters since start."""
        sched = self.scheduler
        pages, states = sched.pages, sched.states
        asked = sched.stats.tokens_asked
        return {
            "prefix_caching": self.config.enable_prefix_caching,
            "tokens_asked": asked,
            "tokens_hit": sched.stats.tokens_hit,
            "hit_rate": sched.stats.tokens_hit / asked if asked else 0.0,
            "kv_pages_in_use": pages.num_in_use if pages else 0,
            "kv_pages_cached": pages.num_cached if pages else 0,
            "kv_pages_usable": pages.num_usable if pages else 0,
            "kv_page_evictions": pages.evictions if pages else 0,
            "ssm_live_slots_in_use": len(states.live) if states else 0,
            "ssm_snapshots_held": len(states.snapshots) if states else 0,
            "ssm_snapshot_slots": states.num_snapshots if states else 0,
            "ssm_snapshot_evictions": states.evictions if states else 0,
            "preemptions": sched.num_preemptions,
            "peak_kv_pages_in_use": self.peak_pages_in_use,
            "peak_ssm_live_slots_in_use": self.peak_slots_in_use,
        }

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.model_config.eos_token_ids):
                seq.finish_reason = "stop"
                return
            if p.stop and self.tokenizer is not None:
                text = self.decode(seq)
                hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
                if hits:
                    seq.stop_text_cut = min(hits)
                    seq.finish_reason = "stop"
                    return
        if seq.num_output_tokens >= p.max_tokens:
            seq.finish_reason = "length"

    # ------------------------------------------------------------------ outputs

    def decode(self, seq: Sequence) -> str:
        """The output text so far, cut before a matched stop string."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        return text if seq.stop_text_cut is None else text[: seq.stop_text_cut]

    def output(self, seq: Sequence) -> RequestOutput:
        metrics = RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time, seq.num_preemptions)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.tokens[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            text=self.decode(seq) if self.tokenizer is not None else None,
            finish_reason=seq.finish_reason,
            num_cached_tokens=seq.num_cached_tokens or 0,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            metrics=metrics,
        )

    # ------------------------------------------------------------------ prompt logits

    def prompt_logits(self, token_ids: list[int], chunk_sizes: list[int]) -> np.ndarray:
        """Every position's logits for one prompt, prefilled in steps of `chunk_sizes`.
        Must not run while requests are in flight (it borrows pages and slots)."""
        if self.scheduler.has_unfinished:
            raise RuntimeError("prompt_logits cannot run while requests are in flight")
        seq = Sequence("prompt_logits", 0, list(token_ids), len(token_ids), SamplingParams(), 0)
        sched = self.scheduler
        if sched.states is not None:
            seq.owned_slots = sched.states.alloc_live(2)
            seq.read_slot = seq.owned_slots[0]
        rows = []
        try:
            for n in chunk_sizes:
                if not sched.grow_pages(seq, seq.num_computed + n):
                    raise ValueError(f"prompt of {len(token_ids)} tokens does not fit in the KV pool")
                shape = Shape(max(16, 1 << (n - 1).bit_length()), 1, decode=False)
                batch, _ = self.builder.build(ScheduledStep([seq], [n]), shape)
                rows.append(np.asarray(self.runner.logits(batch, all_logits=True))[:n])
                seq.num_computed += n
                if seq.owned_slots:
                    seq.read_slot = seq.write_slot
        finally:
            sched.release(seq)
        return np.concatenate(rows)
