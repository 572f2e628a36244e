"""The public entry point: `LLM(model=...)` with `generate`, `generate_stream` and `prompt_logits`."""

from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from jaxengine.engine.engine_config import EngineConfig, check_engine_keys
from jaxengine.engine.llm_engine import LLMEngine
from jaxengine.engine.outputs import RequestOutput, StreamOutput
from jaxengine.engine.sampling_params import SamplingParams

# A prompt is text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids} that
# may also carry a "cache_salt": requests with different salts never share cached prefixes.
Prompt = str | Sequence[int] | dict


class LLM:
    """Loads a model directory and serves prompts with continuous batching.

    Keyword arguments are the fields of `EngineConfig` (vLLM's names): `max_model_len`,
    `max_num_seqs`, `max_num_batched_tokens`, `page_size`, `num_cache_blocks` or
    `kv_cache_memory_bytes`, `prefix_cache_retention_interval`, `compilation_cache_dir`,
    `warm_up`, ..."""

    def __init__(self, model: str | Path, dtype: str = "float32", **engine_args):
        check_engine_keys(sorted(engine_args))
        self.engine = LLMEngine(model, EngineConfig(dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        if self.engine.config.warm_up:
            self.warm_up()

    def warm_up(self, progress: bool = True) -> None:
        """Compiles every step shape now, so no request waits for a compile."""
        shapes = self.engine.shapes()
        with tqdm(total=len(shapes), desc="compiling step shapes", leave=False, disable=not progress) as bar:
            self.engine.warm_up(bar.update)

    def _submit(self, prompts: Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None):
        """Validates every request first, so a bad one rejects the call before any work."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of prompts (each a string or a list of token ids)")
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
        return [self.engine.add_request(ids, sp, i, salt) for i, (ids, sp, salt) in enumerate(requests)]

    def stats(self) -> dict:
        """Prefix-cache counters (tokens hit / asked, evictions per pool) and pool use."""
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
            while self.engine.has_unfinished:
                for seq in self.engine.step():
                    if seq.finish_reason is not None:
                        bar.update()
        return [self.engine.output(s) for s in seqs]

    def generate_stream(
        self, prompts: Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StreamOutput]:
        """Yields each request's new tokens and text as soon as a step produces them."""
        seqs = self._submit(prompts, sampling_params)
        sent_tokens = [0] * len(seqs)
        sent_text = [""] * len(seqs)
        while self.engine.has_unfinished:
            for seq in self.engine.step():
                i = seq.index
                text = self.engine.decode(seq)
                new_tokens = seq.output_token_ids[sent_tokens[i] :]
                new_text = text[len(sent_text[i]) :] if text.startswith(sent_text[i]) else text
                sent_tokens[i] += len(new_tokens)
                sent_text[i] = text
                finished = seq.finish_reason is not None
                output = self.engine.output(seq) if finished else None
                yield StreamOutput(i, seq.request_id, new_tokens, new_text, finished, output)

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
        return self.engine.prompt_logits(ids, chunk_sizes)


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
