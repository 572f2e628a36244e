"""Per-request sampling parameters (field names, defaults and meanings follow vLLM)."""

import copy
import dataclasses
import enum
import math
import numbers
from typing import Any

import numpy as np

MAX_N = 64  # samples per prompt
MAX_STOP_TOKEN_IDS = 16  # stop/eos ids that min_tokens can hold back, per request
# Room in each step's fixed-shape arrays, per request:
MAX_LOGIT_BIAS = 64  # logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 256  # allowed_token_ids
MAX_BAD_WORDS = 32  # bad_words token sequences (a word counts once per tokenization)
INT32_MAX = 2**31 - 1
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
FLOAT_MAX = float(np.finfo(np.float32).max)  # the step's float32 arrays hold at most this


@dataclasses.dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: the output must follow exactly one of a JSON schema (`json`:
    a dict, its JSON text, or a pydantic model's `model_json_schema()`), a regular expression,
    one of the strings in `choice`, a Lark grammar (`grammar`), or any JSON object
    (`json_object=True`). Checked when the request is submitted (`structured_output.py`)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond ", " and ": " between items

    KINDS = ("json", "regex", "choice", "grammar", "json_object")
    OPTIONS = ("disable_any_whitespace",)

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """From a mapping (YAML, JSON request bodies) or an instance; unknown keys are an error."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"SamplingParams.structured_outputs must be a mapping, got {type(value).__name__}")
        known = cls.KINDS + cls.OPTIONS
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(
                f"SamplingParams.structured_outputs: unknown key {unknown[0]!r}; known: {', '.join(known)}"
            )
        return cls(**value)

    @property
    def given(self) -> list[str]:
        """The kinds set (exactly one is valid)."""
        return [k for k in self.KINDS if getattr(self, k) not in (None, False)]


class RequestOutputKind(enum.IntEnum):
    """vLLM's streaming kinds. `LLM.generate` returns final outputs whatever the kind, and
    `generate_stream` always yields deltas, as vLLM's offline `LLM` does."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclasses.dataclass
class SamplingParams:
    """How to pick each new token of one request.

    Penalties apply first (repetition: prompt and output tokens; presence and frequency:
    output tokens), then temperature (0 means greedy), then top-k, top-p and min-p filters.
    `seed` makes a request's draws reproducible whatever else shares its batch (-1 or None:
    no seed). `logprobs=N` returns the top-N log-probabilities (of the model's raw
    distribution) of each step, and the chosen token's. `n` samples per prompt share the
    prompt's cached pages and checkpoint. `max_tokens=None`: up to max_model_len."""

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = (
        None  # words the output may not contain (as tokenized, with and without a leading space)
    )
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these may be drawn
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as max_model_len allows)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Accept lists, a single string and None for the tuple fields, as vLLM users write them.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is None:
                value = ()
            elif isinstance(value, str):
                value = (value,)
            elif isinstance(value, list):
                value = tuple(value)
            setattr(self, name, value)
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's name)."""
        return copy.deepcopy(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "") -> "SamplingParams":
        """Builds from a mapping; an unknown key is a ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in values:
            if key not in known:
                prefix = f"{where}: " if where else ""
                raise ValueError(f"{prefix}unknown sampling parameter {key!r}; known: {', '.join(sorted(known))}")
        return cls(**values)

    def validate(self, where: str = "", *, vocab_size: int | None = None, max_logprobs: int = 20) -> None:
        """Raises ValueError naming the bad field (and `where`, e.g. the request). Numbers must
        be finite and of the field's type; integers fit the step's int32 arrays."""
        prefix = f"{where}: " if where else ""

        def fail(field: str, rule: str) -> None:
            raise ValueError(f"{prefix}SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

        def number(field: str, low: float, high: float, *, low_open: bool = False, integer: bool = False) -> None:
            value = getattr(self, field)
            ok = is_int(value) if integer else is_num(value) and _finite(value)
            if not ok or not (low < value if low_open else low <= value) or value > high:
                kind = "an integer" if integer else "a finite number"
                fail(field, f"must be {kind} in {'(' if low_open else '['}{low:g}, {high:g}]")

        number("n", 1, MAX_N, integer=True)
        if self.max_tokens is not None:
            number("max_tokens", 1, INT32_MAX, integer=True)
        number("temperature", 0, FLOAT_MAX)
        number("top_k", -1, UINT64_MAX, integer=True)  # above the vocabulary: no limit
        number("top_p", 0, 1, low_open=True)
        number("min_p", 0, 1)
        number("presence_penalty", -2, 2)
        number("frequency_penalty", -2, 2)
        number("repetition_penalty", 0, FLOAT_MAX, low_open=True)
        if self.seed is not None:
            number("seed", INT64_MIN, UINT64_MAX, integer=True)
        number("min_tokens", 0, INT32_MAX if self.max_tokens is None else self.max_tokens, integer=True)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        ids_ok = (
            all(
                is_int(t) and (0 <= t < vocab_size if vocab_size is not None else 0 <= t <= INT32_MAX)
                for t in self.stop_token_ids
            )
            if isinstance(self.stop_token_ids, tuple)
            else False
        )
        if not ids_ok:
            fail("stop_token_ids", f"must be token ids in [0, {vocab_size if vocab_size is not None else INT32_MAX})")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS - 2:
            fail("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS - 2} ids")
        if self.logprobs is not None:
            number("logprobs", 0, max_logprobs, integer=True)
        if self.prompt_logprobs is not None:
            number("prompt_logprobs", 0, max_logprobs, integer=True)
        for field in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            if not isinstance(getattr(self, field), bool):
                fail(field, "must be true or false")
        if self.stop and not self.detokenize:
            fail("stop", "needs detokenize=True (stop strings are matched in the output text)")
        if self.output_kind not in tuple(RequestOutputKind):
            fail("output_kind", f"must be one of {', '.join(k.name for k in RequestOutputKind)}")
        in_vocab = (lambda t: is_int(t) and 0 <= t < vocab_size) if vocab_size is not None else is_int
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                in_vocab(t) and is_num(b) and _finite(b) for t, b in self.logit_bias.items()
            ):
                fail("logit_bias", "must map token ids in the vocabulary to finite numbers")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                fail("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(in_vocab(t) for t in ids):
                fail("allowed_token_ids", "must be a non-empty list of token ids in the vocabulary")
            if len(ids) > MAX_ALLOWED_TOKEN_IDS:
                fail("allowed_token_ids", f"may hold at most {MAX_ALLOWED_TOKEN_IDS} ids")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1:
            number("truncate_prompt_tokens", 1, INT32_MAX, integer=True)
        if self.structured_outputs is not None:
            given = self.structured_outputs.given
            if len(given) != 1:
                fail("structured_outputs", f"must set exactly one of {', '.join(StructuredOutputsParams.KINDS)}")
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in self.bad_words
            ):
                fail("bad_words", "must be a list of non-blank strings")
            if 2 * len(self.bad_words) > MAX_BAD_WORDS:
                fail("bad_words", f"may hold at most {MAX_BAD_WORDS // 2} words")

    @property
    def step_seed(self) -> int | None:
        """The seed as the step's uint32 array holds it: any 64-bit integer, reduced to its
        low 32 bits (two's complement for negative seeds)."""
        return None if self.seed is None else int(self.seed) & 0xFFFFFFFF


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond float range
        return False


def is_int(value: Any) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_num(value: Any) -> bool:
    """A Python or numpy real number, not a bool."""
    return isinstance(value, (numbers.Real, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_))
