"""From a caller's prompt and sampling params to a validated `Sequence`."""

import dataclasses
import zlib
from pathlib import Path

import numpy as np

from jaxengine.engine.sampling_params import SamplingParams, is_int
from jaxengine.engine.sequence import Sequence
from jaxengine.engine.spec.state import SpecState
from jaxengine.engine.structured_output import GrammarCompiler


@dataclasses.dataclass(frozen=True)
class InputProcessor:
    """Validates requests before any device work (a ValueError naming the request and the
    field) and makes their sequences, as vLLM's input processing does: tokenizing, prompt
    truncation, max_tokens capped at max_model_len, per-sample seeds, bad words tokenized."""

    model_dir: Path
    tokenizer: object | None  # None: token-id prompts only
    vocab_size: int
    max_model_len: int
    max_logprobs: int
    page_size: int
    pool_pages: int | None  # pages the cache pool holds (None: the model has no KV)
    engine_seed: int  # unseeded requests draw from keys derived from it and their request id
    grammars: GrammarCompiler  # structured outputs' grammars, compiled once each

    def validate(self, prompt: str | list[int], params: SamplingParams, where: str) -> list[int]:
        """The prompt's token ids, or a ValueError naming the request and the field."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"{where}: sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(where, vocab_size=self.vocab_size, max_logprobs=self.max_logprobs)
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
        if params.structured_outputs is not None:
            self.grammars.compiled(params.structured_outputs, where)  # checked now, cached for its samples
        if params.bad_words and self.tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.bad_words needs a tokenizer.json in {self.model_dir}")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"{where}: the prompt ({len(ids)} tokens) leaves no room for output within "
                f"max_model_len={self.max_model_len}"
            )
        total = len(ids) + self.max_output_tokens(len(ids), params)
        if self.pool_pages is not None and -(-total // self.page_size) > self.pool_pages:
            raise ValueError(f"{where}: needs {total} tokens of KV cache, more than the whole pool holds")
        return ids

    def max_output_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """`max_tokens`, capped (as vLLM caps it) where the output would pass max_model_len."""
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        index: int,
        cache_salt: str | None,
        *,
        sample: int,
        prompt: str | None,
        speculates: bool,
    ) -> Sequence:
        """A validated request's sequence. It keeps its own copy of `params`, with max_tokens
        resolved and, for sample j of a seeded prompt, seed + j (as vLLM seeds its n samples);
        `speculates`: the engine speculates (the sequence gets a `SpecState`)."""
        max_tokens = self.max_output_tokens(len(token_ids), params)
        params = dataclasses.replace(
            params,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            seed=None if params.seed is None else params.seed + sample,
        )
        seed = params.step_seed if params.seed is not None else zlib.crc32(f"{self.engine_seed}/{request_id}".encode())
        return Sequence(
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
            spec=SpecState(allowed=params.structured_outputs is None) if speculates else None,
            matcher=self.grammars.matcher(params.structured_outputs, f"request {request_id}")
            if params.structured_outputs is not None
            else None,
        )

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
