"""Data parallelism: `data_parallel_size` replicas of one engine behind one front.

Each replica is a whole `LLMEngine` on its own `tensor_parallel_size` devices (replica r on
devices r * tp to (r + 1) * tp - 1), with its own scheduler, pools and prefix cache. A request
goes to the replica that last served the longest page-aligned prefix of its prompt, so the
next turn of a conversation, a repeated system prompt or a prompt's other samples find their
KV pages and checkpoints again; a prompt no replica has seen goes to the least loaded one. The
router keeps its own record of which replica served which prefix (block hashes, as the
prefix cache names them) and never asks the caches, whose reuse model learns from lookups.
A step steps every replica that has work, each on its own thread: their device work overlaps.
"""

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np

from jaxengine.cache.block_hash import extend_hashes, root_hash
from jaxengine.engine.batch_builder import Shape
from jaxengine.engine.engine_config import EngineConfig
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.mesh import Parallelism
from jaxengine.engine.outputs import RequestOutput
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Sequence, Status


class DataParallelEngine:
    """The `LLMEngine` interface over several replicas (see the module docstring)."""

    def __init__(self, model: str | Path, config: EngineConfig):
        config.validate()
        dp, tp = config.data_parallel_size, config.tensor_parallel_size
        available = len(jax.devices())
        if dp * tp > available:
            raise ValueError(
                f"engine argument data_parallel_size={dp} with tensor_parallel_size={tp} needs {dp * tp} "
                f"devices; {available} {jax.default_backend()} devices are present"
            )
        one = dataclasses.replace(config, data_parallel_size=1)
        self.replicas = [
            LLMEngine(model, one, Parallelism(tp, config.enable_expert_parallel, first_device=r * tp))
            for r in range(dp)
        ]
        first = self.replicas[0]
        self.config, self.model_dir, self.tokenizer = config, first.model_dir, first.tokenizer
        self.max_model_len, self.page_size = first.max_model_len, config.page_size
        self._owner: dict[str, LLMEngine] = {}  # request id -> its replica
        # Page-aligned prefix hash (and whole-prompt key) -> the replica that last served it,
        # least recently used first; as many entries as all replicas' cache blocks.
        self._served: collections.OrderedDict[object, int] = collections.OrderedDict()
        self._max_served = sum(r.scheduler.cache.pool.num_usable for r in self.replicas)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=dp, thread_name_prefix="jaxengine-replica")

    # ------------------------------------------------------------------ routing

    def _keys(self, token_ids: list[int], cache_salt: str | None) -> list[object]:
        """The prompt's page-aligned prefix hashes, longest first, then the whole prompt."""
        hashes = extend_hashes([], token_ids, self.page_size, root_hash(cache_salt))
        return [*reversed(hashes), (cache_salt, tuple(token_ids))]

    def _route(self, keys: list[object]) -> int:
        """The replica that served the longest of `keys`, unless it has a full batch more
        unfinished requests than the least loaded one; else the least loaded."""
        load = [len(r.requests) for r in self.replicas]
        least = int(np.argmin(load))
        served = next((self._served[k] for k in keys if k in self._served), None)
        if served is not None and load[served] < load[least] + self.config.max_num_seqs:
            return served
        return least

    def _remember(self, keys: list[object], replica: int) -> None:
        for key in keys:
            self._served[key] = replica
            self._served.move_to_end(key)
        while len(self._served) > self._max_served:
            self._served.popitem(last=False)

    # ------------------------------------------------------------------ the engine interface

    @property
    def requests(self) -> collections.ChainMap:
        return collections.ChainMap(*(r.requests for r in self.replicas))

    @property
    def compile_seconds(self) -> float:
        return sum(r.compile_seconds for r in self.replicas)

    @property
    def has_unfinished(self) -> bool:
        return any(r.has_unfinished for r in self.replicas)

    def shapes(self) -> list[Shape]:
        """Every step shape of every replica (each compiles its own, for its devices)."""
        return [s for r in self.replicas for s in r.shapes()]

    def warm_up(self, progress: Callable[[], None] | None = None) -> None:
        for replica in self.replicas:
            replica.warm_up(progress)

    def validate_request(self, prompt: str | list[int], params: SamplingParams, where: str) -> list[int]:
        return self.replicas[0].validate_request(prompt, params, where)

    def new_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        index: int = 0,
        cache_salt: str | None = None,
        *,
        sample: int = 0,
        prompt: str | None = None,
    ) -> Sequence:
        """A request on the replica its prompt's prefix leads to (see the module docstring);
        a prompt's samples after the first on the first's replica, whose pages they share."""
        keys = self._keys(token_ids, cache_salt)
        with self._lock:
            r = self._served[keys[-1]] if sample > 0 and keys[-1] in self._served else self._route(keys)
            self._remember(keys, r)
            request_id = str(next(self._ids))
        replica = self.replicas[r]
        seq = replica.new_request(
            token_ids, params, index, cache_salt, sample=sample, prompt=prompt, request_id=request_id
        )
        self._owner[request_id] = replica
        return seq

    def enqueue(self, seq: Sequence) -> None:
        self._owner[seq.request_id].enqueue(seq)

    def abort(self, seq: Sequence) -> None:
        owner = self._owner.get(seq.request_id)
        if owner is not None:  # else it finished and left its replica already
            owner.abort(seq)
        for s in [seq, *seq.followers]:
            self._owner.pop(s.request_id, None)

    def step(self) -> list[Sequence]:
        """One step of every replica with work, side by side; the sequences that received a
        token. A replica whose step raises recovers as a lone engine does; the first error is
        raised once every replica's step has ended."""
        busy = [r for r in self.replicas if r.has_unfinished]
        futures = [self._threads.submit(r.step) for r in busy]
        done, errors = [], []
        for future in futures:
            try:
                done.extend(future.result())
            except Exception as err:  # raised below, once every replica's step has ended
                errors.append(err)
        for seq in done:
            if seq.status is Status.FINISHED:
                self._owner.pop(seq.request_id, None)
        if errors:
            raise errors[0]
        return done

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.reset_prefix_cache()
        self._served.clear()

    def output(self, samples: list[Sequence]) -> RequestOutput:
        return self.replicas[0].output(samples)

    def decode(self, seq: Sequence) -> str:
        return self.replicas[0].decode(seq)

    def prompt_logits(self, token_ids: list[int], chunk_sizes: list[int]):
        return self.replicas[0].prompt_logits(token_ids, chunk_sizes)

    def stats(self) -> dict:
        """The replicas' counters added up (rates over the sums; other figures averaged), and
        each replica's own under "replicas"."""
        each = [r.stats() for r in self.replicas]
        merged = dict(each[0])
        for key, value in each[0].items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            values = [s[key] for s in each]
            merged[key] = sum(values) if isinstance(value, int) else sum(values) / len(values)
        asked = merged["tokens_asked"]
        merged["hit_rate"] = merged["tokens_hit"] / asked if asked else 0.0
        return {**merged, "data_parallel_size": len(each), "replicas": each}
