"""Per-request sampling parameters (field names and meanings follow vLLM)."""

import dataclasses
import math
import numbers
from typing import Any

import numpy as np

MAX_STOP_TOKEN_IDS = 16  # stop/eos ids that min_tokens can hold back, per request
INT32_MAX = 2**31 - 1
INT64_MIN, UINT64_MAX = -(2**63), 2**64 - 1
FLOAT_MAX = float(np.finfo(np.float32).max)  # the step's float32 arrays hold at most this


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request.

    Penalties apply first (repetition: prompt and output tokens; presence and frequency:
    output tokens), then temperature (0 means greedy), then top-k, top-p and min-p filters.
    `seed` makes a request's draws reproducible whatever else shares its batch. `logprobs=N`
    returns the top-N log-probabilities (of the model's raw distribution) of each step."""

    max_tokens: int = 16
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
    skip_special_tokens: bool = True

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
            object.__setattr__(self, name, value)

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
        number("min_tokens", 0, self.max_tokens, integer=True)
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        ids_ok = all(is_int(t) and (0 <= t < vocab_size if vocab_size is not None else 0 <= t <= INT32_MAX)
                     for t in self.stop_token_ids) if isinstance(self.stop_token_ids, tuple) else False
        if not ids_ok:
            fail("stop_token_ids", f"must be token ids in [0, {vocab_size if vocab_size is not None else INT32_MAX})")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS - 2:
            fail("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS - 2} ids")
        if self.logprobs is not None:
            number("logprobs", 0, max_logprobs, integer=True)
        for field in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, field), bool):
                fail(field, "must be true or false")

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
