"""The public entry point: `LLM(model=...)` with `prompt_logits` and `generate`.

This first driver is static: a group of up to `max_num_seqs` prompts is prefilled (split
into steps of at most `max_num_batched_tokens` tokens), then decoded one token per sequence
per step until every sequence stops. Each sequence owns a fixed run of KV pages and two SSM
slots that it alternates between (read one, write the other), so every step exercises the
same read/write-slot path that prefix caching relies on.
"""

import dataclasses
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.engine.runner import ModelRunner
from jaxengine.engine.sampler import SamplingParams, sample
from jaxengine.engine.tokenizer import load_tokenizer
from jaxengine.models.batch import StepBatch
from jaxengine.models.loader import load_model

Prompt = str | Sequence[int]


@dataclasses.dataclass
class RequestOutput:
    """The result of one prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (end-of-sequence token) or "length" (max_tokens reached)


@dataclasses.dataclass
class _Sequence:
    """Host-side state of one sequence in the static driver."""

    tokens: list[int]
    num_prompt: int
    params: SamplingParams
    pages: np.ndarray  # [pages_per_seq] int32
    slots: tuple[int, int]  # the two SSM slots it alternates between
    num_computed: int = 0
    steps_done: int = 0
    finish_reason: str | None = None

    def slots_for_step(self) -> tuple[int, int]:
        """(read, write): step k reads the slot step k - 1 wrote."""
        parity = self.steps_done % 2
        return self.slots[parity], self.slots[1 - parity]


def _bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return 1 << max(math.ceil(math.log2(max(n, 1))), int(math.log2(minimum)))


class LLM:
    """Loads a model directory and runs prompts through the paged, ragged model step."""

    def __init__(
        self,
        model: str | Path,
        dtype: str = "float32",
        *,
        max_model_len: int | None = None,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        page_size: int = 16,
        kernels: str = "reference",
    ):
        self.model_dir = Path(model)
        self.cfg, graphdef, params = load_model(self.model_dir, dtype, kernels)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_model_len = max_model_len or min(self.cfg.max_position_embeddings, 4096)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_size = page_size
        self.pages_per_seq = math.ceil(self.max_model_len / page_size)
        self.runner = ModelRunner(
            self.cfg,
            graphdef,
            params,
            num_pages=1 + max_num_seqs * self.pages_per_seq,
            page_size=page_size,
            num_slots=1 + 2 * max_num_seqs,
        )

    # ---------------------------------------------------------------- validation

    def _token_ids(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index}: text prompts need a tokenizer.json in {self.model_dir}")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index}: the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        return ids

    def _check_length(self, n: int, index: int) -> None:
        if n > self.max_model_len:
            raise ValueError(f"prompt {index}: prompt + max_tokens = {n} tokens exceeds max_model_len={self.max_model_len}")

    # ---------------------------------------------------------------- steps

    def _batch(self, seqs: list[_Sequence], counts: list[int], decode: bool) -> StepBatch:
        """The ragged batch that feeds `counts[i]` new tokens of `seqs[i]`."""
        num_tokens = sum(counts)
        t_bucket = _bucket(len(seqs), 1) if decode else _bucket(num_tokens, 16)
        s_bucket = t_bucket if decode else _bucket(len(seqs), 1)
        ids = np.zeros(t_bucket, np.int32)
        cu = np.full(s_bucket + 1, num_tokens, np.int32)
        kv_lens = np.zeros(s_bucket, np.int32)
        pages = np.zeros((s_bucket, self.pages_per_seq), np.int32)
        read = np.zeros(s_bucket, np.int32)
        write = np.zeros(s_bucket, np.int32)
        offset = 0
        for i, (seq, n) in enumerate(zip(seqs, counts)):
            start = seq.num_computed
            ids[offset : offset + n] = seq.tokens[start : start + n]
            cu[i] = offset
            offset += n
            kv_lens[i] = start + n
            pages[i] = seq.pages
            read[i], write[i] = seq.slots_for_step()
        return StepBatch(ids, cu, kv_lens, pages, read, write)

    def _run(self, seqs: list[_Sequence], counts: list[int], *, decode: bool, all_logits: bool) -> jax.Array:
        batch = self._batch(seqs, counts, decode)
        logits = self.runner.step(batch, decode=decode, all_logits=all_logits)
        for seq, n in zip(seqs, counts):
            seq.num_computed += n
            seq.steps_done += 1
        return logits

    def _new_sequences(self, token_lists: list[list[int]], params: list[SamplingParams]) -> list[_Sequence]:
        seqs = []
        for i, (tokens, p) in enumerate(zip(token_lists, params)):
            first_page = 1 + i * self.pages_per_seq
            pages = np.arange(first_page, first_page + self.pages_per_seq, dtype=np.int32)
            seqs.append(_Sequence(list(tokens), len(tokens), p, pages, (1 + 2 * i, 2 + 2 * i)))
        return seqs

    # ---------------------------------------------------------------- public API

    def prompt_logits(self, token_ids: Sequence[int], chunk_sizes: Sequence[int] | None = None) -> np.ndarray:
        """Logits after every prompt token, `[len, vocab]` float32, via the paged prefill path.

        `chunk_sizes` splits the prefill into steps of those sizes (they must sum to the
        prompt length); by default steps of at most `max_num_batched_tokens`."""
        ids = self._token_ids(token_ids, 0)
        self._check_length(len(ids), 0)
        if chunk_sizes is None:
            step = self.max_num_batched_tokens
            chunk_sizes = [min(step, len(ids) - s) for s in range(0, len(ids), step)]
        if sum(chunk_sizes) != len(ids) or min(chunk_sizes) < 1:
            raise ValueError(f"chunk_sizes must be positive and sum to the prompt length {len(ids)}, got {list(chunk_sizes)}")
        (seq,) = self._new_sequences([ids], [SamplingParams()])
        rows = []
        for n in chunk_sizes:
            rows.append(np.asarray(self._run([seq], [n], decode=False, all_logits=True))[:n])
        return np.concatenate(rows)

    def generate(
        self, prompts: Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Generates a completion for each prompt (text or token ids); outputs in input order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (each a string or a list of token ids)")
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        token_lists = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            p.validate(f"prompt {i}")
            ids = self._token_ids(prompt, i)
            self._check_length(len(ids) + p.max_tokens, i)
            token_lists.append(ids)
        outputs = []
        for start in range(0, len(prompts), self.max_num_seqs):
            group = slice(start, start + self.max_num_seqs)
            outputs.extend(self._generate_group(token_lists[group], params[group], start))
        return outputs

    def _generate_group(self, token_lists: list[list[int]], params: list[SamplingParams], first_index: int) -> list[RequestOutput]:
        seqs = self._new_sequences(token_lists, params)
        seeds = [
            p.seed if p.seed is not None else zlib.crc32(f"{first_index + i}".encode()) for i, p in enumerate(params)
        ]
        # Prefill: pack prompt pieces into steps of at most max_num_batched_tokens.
        last_logits: dict[int, jax.Array] = {}
        while any(s.num_computed < s.num_prompt for s in seqs):
            budget = self.max_num_batched_tokens
            chosen, counts = [], []
            for i, s in enumerate(seqs):
                n = min(s.num_prompt - s.num_computed, budget)
                if n > 0:
                    chosen.append(i)
                    counts.append(n)
                    budget -= n
            logits = self._run([seqs[i] for i in chosen], counts, decode=False, all_logits=False)
            for row, i in enumerate(chosen):
                if seqs[i].num_computed == seqs[i].num_prompt:
                    last_logits[i] = logits[row]
        logits = jnp.stack([last_logits[i] for i in range(len(seqs))])
        active = list(range(len(seqs)))
        while True:
            tokens = self._sample(logits, [seqs[i] for i in active], [seeds[i] for i in active])
            for i, tok in zip(active, tokens):
                self._append(seqs[i], int(tok))
            active = [i for i in active if seqs[i].finish_reason is None]
            if not active:
                break
            logits = self._run([seqs[i] for i in active], [1] * len(active), decode=True, all_logits=False)
            logits = logits[: len(active)]
        return [self._output(s) for s in seqs]

    def _sample(self, logits: jax.Array, seqs: list[_Sequence], seeds: list[int]) -> np.ndarray:
        temps = jnp.asarray([s.params.temperature for s in seqs], jnp.float32)
        steps = jnp.asarray([len(s.tokens) - s.num_prompt for s in seqs], jnp.int32)
        return np.asarray(sample(logits, temps, jnp.asarray(seeds, jnp.uint32), steps))

    def _append(self, seq: _Sequence, token: int) -> None:
        seq.tokens.append(token)
        if not seq.params.ignore_eos and token in self.cfg.eos_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.tokens) - seq.num_prompt >= seq.params.max_tokens:
            seq.finish_reason = "length"

    def _output(self, seq: _Sequence) -> RequestOutput:
        generated = seq.tokens[seq.num_prompt :]
        text = self.tokenizer.decode(generated, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(seq.tokens[: seq.num_prompt], generated, text, seq.finish_reason)
