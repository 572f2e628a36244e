"""The on-device sampler, run inside the jitted step on each sequence's last-token logits."""

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingBatch:
    """Per-sequence sampling settings of one step, padded to the sequence bucket `S`."""

    temperature: jax.Array  # [S] float32; 0 = greedy
    top_k: jax.Array  # [S] int32; 0 = off
    top_p: jax.Array  # [S] float32
    min_p: jax.Array  # [S] float32
    presence_penalty: jax.Array  # [S] float32
    frequency_penalty: jax.Array  # [S] float32
    repetition_penalty: jax.Array  # [S] float32
    seeds: jax.Array  # [S] uint32
    steps: jax.Array  # [S] int32: index of the output token being drawn
    history: jax.Array  # [S, L] int32: prompt then output tokens, -1 padded
    prompt_lens: jax.Array  # [S] int32
    banned: jax.Array  # [S, B] int32: ids that may not be drawn now (min_tokens), -1 padded
    wants_logprobs: jax.Array  # [S] bool: the row asked for its top log-probabilities


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What the step returns per sequence."""

    tokens: jax.Array  # [S] int32
    logprob: jax.Array  # [S] float32: raw log-probability of the chosen token
    top_logprobs: jax.Array  # [S, K] float32: the K most likely tokens' raw log-probabilities (0 unless asked)
    top_ids: jax.Array  # [S, K] int32 (0 unless some row asked)


def _apply_penalties(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    num_seqs, vocab = logits.shape
    length = sb.history.shape[1]
    valid = sb.history >= 0
    is_output = valid & (jnp.arange(length)[None, :] >= sb.prompt_lens[:, None])
    rows = jnp.arange(num_seqs)[:, None]
    ids = jnp.clip(sb.history, 0, vocab - 1)
    out_counts = jnp.zeros((num_seqs, vocab), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32))
    seen = jnp.zeros((num_seqs, vocab), bool).at[rows, ids].max(valid)
    rep = sb.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sb.frequency_penalty[:, None] * out_counts
    return logits - sb.presence_penalty[:, None] * (out_counts > 0)


def _filter(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Top-k, then top-p, then min-p; removed tokens get -inf."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
    sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted token
    keep_sorted = before < sb.top_p[:, None]
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.where(p < sb.min_p[:, None] * p.max(axis=-1, keepdims=True), -jnp.inf, logits)


def sample_tokens(logits: jax.Array, sb: SamplingBatch, num_logprobs: int) -> SampleOutput:
    """Samples one token per row of `logits` [S, V] under each row's settings."""
    logits = jnp.asarray(logits, jnp.float32)
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    rows = jnp.arange(logits.shape[0])[:, None]
    logits = logits.at[rows, jnp.clip(sb.banned, 0, logits.shape[1] - 1)].min(
        jnp.where(sb.banned >= 0, -jnp.inf, jnp.inf)
    )
    # Penalties scatter every row's history over the vocabulary: only when some row has one.
    penalised = jnp.any(sb.repetition_penalty != 1) | jnp.any(sb.frequency_penalty != 0) | jnp.any(
        sb.presence_penalty != 0
    )
    logits = jax.lax.cond(penalised, _apply_penalties, lambda logits, sb: logits, logits, sb)
    greedy = jnp.argmax(logits, axis=-1)
    temp = jnp.where(sb.temperature > 0, sb.temperature, 1.0)

    def draw(row: jax.Array, seed: jax.Array, step: jax.Array) -> jax.Array:
        return jax.random.categorical(jax.random.fold_in(jax.random.key(seed), step), row)

    def sample(scaled: jax.Array) -> jax.Array:  # [S, V] -> [S]
        return jax.vmap(draw)(_filter(scaled, sb), sb.seeds, sb.steps).astype(greedy.dtype)

    # The filters sort the vocabulary and the draw makes V random numbers per row: skip
    # both when every row is greedy.
    drawn = jax.lax.cond(jnp.any(sb.temperature > 0), sample, lambda scaled: greedy, logits / temp[:, None])
    tokens = jnp.where(sb.temperature > 0, drawn, greedy).astype(jnp.int32)
    def top(logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
        values, ids = jax.lax.top_k(logprobs, num_logprobs)
        return values, ids.astype(jnp.int32)

    def none(logprobs: jax.Array) -> tuple[jax.Array, jax.Array]:
        rows = logprobs.shape[0]
        return jnp.zeros((rows, num_logprobs), jnp.float32), jnp.zeros((rows, num_logprobs), jnp.int32)

    top_logprobs, top_ids = jax.lax.cond(jnp.any(sb.wants_logprobs), top, none, raw_logprobs)
    chosen = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]
    return SampleOutput(tokens, chosen, top_logprobs, top_ids)
