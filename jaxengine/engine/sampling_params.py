"""Per-request sampling parameters (field names and meanings follow vLLM)."""

import dataclasses
from typing import Any

MAX_STOP_TOKEN_IDS = 16  # stop/eos ids that min_tokens can hold back, per request


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
        # Accept lists for the tuple fields, as vLLM users write them.
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

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
        """Raises ValueError naming the bad field (and `where`, e.g. the request)."""
        prefix = f"{where}: " if where else ""

        def fail(field: str, rule: str) -> None:
            raise ValueError(f"{prefix}SamplingParams.{field} {rule}, got {getattr(self, field)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "must be an integer >= 1")
        if not is_num(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a number >= 0")
        if not is_int(self.top_k) or self.top_k < -1:
            fail("top_k", "must be an integer >= -1 (0 or -1 disable it)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", "must be in (0, 1]")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            fail("min_p", "must be in [0, 1]")
        for field in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, field)) or not -2 <= getattr(self, field) <= 2:
                fail(field, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            fail("repetition_penalty", "must be > 0")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an integer or None")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", "must be an integer in [0, max_tokens]")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be non-empty strings")
        if not all(is_int(t) and (vocab_size is None or 0 <= t < vocab_size) for t in self.stop_token_ids):
            fail("stop_token_ids", f"must be token ids in [0, {vocab_size})")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS - 2:
            fail("stop_token_ids", f"may hold at most {MAX_STOP_TOKEN_IDS - 2} ids")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= max_logprobs):
            fail("logprobs", f"must be an integer in [0, {max_logprobs}] or None")
