"""Structured outputs on the host: each request's grammar compiled once (by llguidance) and a
matcher per sample that is advanced with every token it accepts and fills that sample's row
of the step's token bitmask (`SamplingBatch.grammar_mask`), which the compiled step applies
to the logits before sampling (`sampler.py`). Requests without a grammar fill nothing.

A request with a grammar does not speculate: its drafts would need a mask per draft position."""

import collections
import json

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np

from jaxengine.engine.sampling_params import StructuredOutputsParams

CACHE_SIZE = 64  # compiled grammars kept, by their text (requests often share one)


def grammar_text(so: StructuredOutputsParams, where: str) -> str:
    """llguidance's grammar for the request's structured output; a ValueError naming the
    field for a value of the wrong kind."""
    field = f"{where}: SamplingParams.structured_outputs"
    (kind,) = so.given
    value = getattr(so, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"{field}.json is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError(f"{field}.json must be a JSON schema (an object), got {type(value).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=_json_options(so, field))
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_json_options(so, field))
    if kind == "regex":
        if not isinstance(value, str):
            raise ValueError(f"{field}.regex must be a string, got {type(value).__name__}")
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{field}.choice must be a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str):
        raise ValueError(f"{field}.grammar must be a Lark grammar (a string), got {type(value).__name__}")
    return llguidance.LLMatcher.grammar_from_lark(value)


def _json_options(so: StructuredOutputsParams, field: str) -> dict | None:
    if not isinstance(so.disable_any_whitespace, bool):
        raise ValueError(f"{field}.disable_any_whitespace must be true or false")
    return {"whitespace_flexible": False} if so.disable_any_whitespace else None


class GrammarCompiler:
    """One engine's grammars: compiled against its tokenizer, cached by text."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._tokenizer = None  # llguidance's view of the tokenizer, made at the first grammar
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def matcher(self, so: StructuredOutputsParams, where: str) -> llguidance.LLMatcher:
        """A fresh matcher for one sample (a copy of the compiled grammar's)."""
        return self.compiled(so, where).deep_copy()

    def compiled(self, so: StructuredOutputsParams, where: str) -> llguidance.LLMatcher:
        """The request's grammar compiled (once per text; the copies start from it); a
        ValueError naming the request and the field if the schema, regex or grammar is not
        valid."""
        if self._hf_tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.structured_outputs needs the model's tokenizer.json")
        text = grammar_text(so, where)
        compiled = self._compiled.get(text)
        if compiled is None:
            error = llguidance.LLMatcher.validate_grammar(text, self._ll_tokenizer())
            if error:
                raise ValueError(
                    f"{where}: SamplingParams.structured_outputs.{so.given[0]} is not valid: {error.strip()}"
                )
            compiled = llguidance.LLMatcher(self._ll_tokenizer(), text)
            if compiled.is_error():
                raise ValueError(
                    f"{where}: SamplingParams.structured_outputs.{so.given[0]} is not valid: {compiled.get_error()}"
                )
            self._compiled[text] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(text)
        return compiled


def fill_row(matcher: llguidance.LLMatcher, bitmask: np.ndarray, row: int) -> None:
    """Row `row` of `bitmask`: the tokens `matcher` allows next."""
    llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, row)
