"""Sampling parameters and the on-device sampler."""

import dataclasses
import functools

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token of one request (names follow vLLM).

    temperature 0 is greedy; otherwise tokens are drawn from softmax(logits / temperature).
    `seed` makes a request's draws reproducible whatever else shares its batch."""

    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False

    def validate(self, where: str = "") -> None:
        """Raises ValueError naming the bad field (and `where`, e.g. the request index)."""
        prefix = f"{where}: " if where else ""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"{prefix}SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"{prefix}SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"{prefix}SamplingParams.seed must be an integer or None, got {self.seed!r}")


@functools.partial(jax.jit)
def sample(
    logits: jax.Array,  # [S, V] float32
    temperatures: jax.Array,  # [S] float32; 0 means greedy
    seeds: jax.Array,  # [S] uint32
    steps: jax.Array,  # [S] int32: tokens the request has generated so far
) -> jax.Array:  # [S] int32
    """Picks one token per row: argmax where temperature is 0, else a draw keyed by
    (seed, step) so that a request's tokens do not depend on its batch neighbours."""
    greedy = jnp.argmax(logits, axis=-1)
    safe_t = jnp.where(temperatures > 0, temperatures, 1.0)

    def draw(row_logits: jax.Array, t: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), step)
        return jax.random.categorical(key, row_logits / t)

    drawn = jax.vmap(draw)(logits, safe_t, seeds, steps)
    return jnp.where(temperatures > 0, drawn, greedy).astype(jnp.int32)
