"""The on-device sampler, run inside the jitted step on the logits of each sequence's sample rows.

A sequence samples after its last token; in a verify step (speculation) after each of its
last `W` tokens: row j of a sequence with d drafts draws output index `steps + j - (W - 1 - d)`
under the same settings and key as a plain decode step drawing that index, with the drafts
before it counted in the penalties' history."""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxengine.models.batch import StepBatch


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
    # [S, L] int32: prompt then output tokens, then drafts; -1 padded (its last token -1 where
    # the host has not read it: `history_ends`). A step without penalties ignores it (and gets
    # one constant array: `device_inputs.py`).
    history: jax.Array
    history_lens: jax.Array  # [S] int32: tokens of `history` before the drafts
    prompt_lens: jax.Array  # [S] int32
    banned: jax.Array  # [S, B] int32: ids that may not be drawn before output index min_tokens, -1 padded
    min_tokens: jax.Array  # [S] int32
    wants_logprobs: jax.Array  # [S] bool: the row asked for its top log-probabilities
    bias_ids: jax.Array  # [S, NB] int32: logit_bias token ids, -1 padded
    bias_values: jax.Array  # [S, NB] float32: added to those tokens' logits
    allowed_ids: jax.Array  # [S, NA] int32: allowed_token_ids, -1 padded (none: every token allowed)
    bad_ids: jax.Array  # [S, NW] int32: tokens that would complete a bad word, -1 padded
    grammar_mask: jax.Array  # [S, ceil(V / 32)] int32: bit t % 32 of word t // 32 set where a grammar allows token t
    constrained: jax.Array  # [S] bool: the sequence follows a grammar (its grammar_mask row applies)
    sample_rows: jax.Array  # [S, W] int32: flat token index of each sample row (the last W tokens)
    num_drafts: jax.Array  # [S] int32: drafts among them (0: only the last row is used)
    next_ids: jax.Array  # [T] int32: per token, the prompt token after it whose log-probability is asked, or -1
    # The drafter's (the MTP module's or draft model's) inputs; [0] in a step without it.
    following_ids: jax.Array  # [T] int32: per token, the token after it where the host knows it, else -1 (MTP's input)
    wants_drafts: jax.Array  # [S] bool: the sequence may verify drafts next step (the MTP module drafts for it)
    speculates: jax.Array  # [S] bool: the sequence speculates (the MTP module runs over a step's tokens if one does)
    # Tokens the host has not read yet (an overlapped loop, `llm_engine.py`): they come from the
    # previous step's `SampleOutput.feed` on the device.
    feed_rows: jax.Array  # [T] int32: per token, the previous step's row whose token it is, or -1 (the host's id)
    history_feed: jax.Array  # [S] int32: the previous step's row whose token ends the history, or -1
    # [S] int32: that token, which the penalties put at the history's end (`_history`), or -1;
    # set on the device by `fed` (the host's is all -1).
    history_ends: jax.Array

    @property
    def runs_drafter(self) -> bool:
        """Whether the step runs the MTP module or draft model (compiled with it)."""
        return self.speculates.shape[0] > 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Per sample row: its sequence, the output index it draws and its history length."""

    seq: jax.Array  # [S * W] int32
    steps: jax.Array  # [S * W] int32
    history_lens: jax.Array  # [S * W] int32


def row_settings(sb: SamplingBatch) -> RowSettings:
    num_seqs, width = sb.sample_rows.shape
    offset = jnp.maximum(jnp.arange(width)[None, :] - (width - 1 - sb.num_drafts[:, None]), 0)  # [S, W]
    seq = jnp.repeat(jnp.arange(num_seqs, dtype=jnp.int32), width)
    return RowSettings(seq, (sb.steps[:, None] + offset).reshape(-1), (sb.history_lens[:, None] + offset).reshape(-1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleOutput:
    """What the step returns per sequence."""

    tokens: jax.Array  # [S, W] int32
    logprob: jax.Array  # [S, W] float32: raw log-probability of the chosen token (0 unless asked)
    top_logprobs: jax.Array  # [S, W, K] float32: the K most likely tokens' raw log-probabilities (0 unless asked)
    top_ids: jax.Array  # [S, W, K] int32 (0 unless some row asked)
    rank: jax.Array  # [S, W] int32: the chosen token's rank in the raw distribution, 1 = most likely (0 unless asked)
    prompt: "PromptLogprobs | None" = None  # set by the engine step
    drafts: jax.Array | None = None  # [S, k] int32: the MTP module's drafts after each sequence's last accepted token
    feed: jax.Array | None = None  # [F] int32: row i's last sampled token at i (F: the largest sequence bucket)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """Per token of the step: the raw log-probability and rank of the prompt token after it
    (`SamplingBatch.next_ids`), and the K most likely tokens there; zeros unless some token asked."""

    logprob: jax.Array  # [T] float32
    rank: jax.Array  # [T] int32
    top_logprobs: jax.Array  # [T, K] float32
    top_ids: jax.Array  # [T, K] int32


def _top_and_rank(logprobs: jax.Array, chosen: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For rows `logprobs` [R, V] and a chosen log-probability per row [R]: its rank (1 = most
    likely) [R], and the k largest log-probabilities [R, k] with their token ids [R, k]."""
    values, ids = jax.lax.top_k(logprobs, k)
    rank = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1)
    return rank.astype(jnp.int32), values, ids.astype(jnp.int32)


def prompt_logprobs(
    head: Callable[[jax.Array], jax.Array], h: jax.Array, next_ids: jax.Array, num_logprobs: int
) -> PromptLogprobs:
    """`PromptLogprobs` from every token's final hidden state `h` [T, D]. The LM head runs on
    all T tokens only in steps where some token asks (prompt_logprobs requests prefilling)."""

    def asked(h: jax.Array) -> PromptLogprobs:
        logprobs = jax.nn.log_softmax(head(h), axis=-1)  # [T, V]
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(next_ids, 0)[:, None], axis=-1)[:, 0]
        return PromptLogprobs(chosen, *_top_and_rank(logprobs, chosen, num_logprobs))

    def none(h: jax.Array) -> PromptLogprobs:
        t = h.shape[0]
        zeros = jnp.zeros((t, num_logprobs), jnp.int32)
        return PromptLogprobs(jnp.zeros(t, jnp.float32), jnp.zeros(t, jnp.int32), zeros.astype(jnp.float32), zeros)

    return jax.lax.cond(jnp.any(next_ids >= 0), asked, none, h)


def _history(sb: SamplingBatch, rows: RowSettings) -> jax.Array:
    """Each row's sequence's history [R, L], ending with the fed token where the host had not
    read it (`fed`). `sb` holds per-row settings but the per-sequence history and its ends."""
    history = jnp.asarray(sb.history)[rows.seq]  # [R, L]
    end = sb.history_ends[rows.seq]  # [R]
    last = jnp.maximum(sb.history_lens - 1, 0)  # [R]: where its sequence's history ends
    at = jnp.arange(history.shape[0])
    return history.at[at, last].set(jnp.where(end >= 0, end, history[at, last]))


def _apply_penalties(logits: jax.Array, sb: SamplingBatch, rows: RowSettings) -> jax.Array:
    """`sb` holds per-row settings; `rows` says which history each row counts."""
    num_rows, vocab = logits.shape
    history = _history(sb, rows)  # [R, L]
    length = history.shape[1]
    valid = (history >= 0) & (jnp.arange(length)[None, :] < rows.history_lens[:, None])
    is_output = valid & (jnp.arange(length)[None, :] >= sb.prompt_lens[:, None])
    row_ids = jnp.arange(num_rows)[:, None]
    ids = jnp.clip(history, 0, vocab - 1)
    out_counts = jnp.zeros((num_rows, vocab), jnp.float32).at[row_ids, ids].add(is_output.astype(jnp.float32))
    seen = jnp.zeros((num_rows, vocab), bool).at[row_ids, ids].max(valid)
    rep = sb.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - sb.frequency_penalty[:, None] * out_counts
    return logits - sb.presence_penalty[:, None] * (out_counts > 0)


def _ban(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """`logits` [R, V] with the tokens `ids` [R, N] (-1: none) of each row set to -inf."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, jnp.clip(ids, 0, logits.shape[1] - 1)].min(jnp.where(ids >= 0, -jnp.inf, jnp.inf))


def _restrict(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """logit_bias, then allowed_token_ids and bad words, as masks over the vocabulary."""
    rows = jnp.arange(logits.shape[0])[:, None]
    vocab = logits.shape[1]
    logits = logits.at[rows, jnp.clip(sb.bias_ids, 0, vocab - 1)].add(jnp.where(sb.bias_ids >= 0, sb.bias_values, 0))
    allowed = jnp.zeros(logits.shape, bool).at[rows, jnp.clip(sb.allowed_ids, 0, vocab - 1)].max(sb.allowed_ids >= 0)
    logits = jnp.where((sb.allowed_ids[:, :1] >= 0) & ~allowed, -jnp.inf, logits)
    return _ban(logits, sb.bad_ids)


def _grammar(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """`logits` [R, V] with the tokens a constrained row's grammar forbids set to -inf."""
    vocab = jnp.arange(logits.shape[1])
    words = jnp.take(sb.grammar_mask, vocab // 32, axis=1)  # [R, V]
    allowed = (jnp.right_shift(words, vocab % 32) & 1) == 1
    return jnp.where(sb.constrained[:, None] & ~allowed, -jnp.inf, logits)


def _filter(logits: jax.Array, sb: SamplingBatch) -> jax.Array:
    """Top-k, then top-p, then min-p; removed tokens get -inf. Each threshold is found by
    bisection over the logits' bit patterns (`_order_keys`), not by sorting the vocabulary:
    the searches cost a few passes over the row, cheaper than a sort of it."""
    vocab = logits.shape[-1]
    keys = _order_keys(logits)  # [R, V]
    k = jnp.where(sb.top_k > 0, jnp.minimum(sb.top_k, vocab), vocab)  # [R]

    def top_k(logits: jax.Array) -> jax.Array:  # the k-th largest key: the largest u with k keys >= u
        kth = _largest(lambda u: jnp.sum(keys >= u[:, None], axis=-1) >= k, keys.shape[0])
        return jnp.where(keys >= kth[:, None], logits, -jnp.inf)

    logits = jax.lax.cond(jnp.any(k < vocab), top_k, lambda logits: logits, logits)

    def top_p(logits: jax.Array) -> jax.Array:
        # A token stays when the mass strictly above it is below p (the smallest prefix of the
        # sorted tokens reaching p, ties kept together): above the largest u whose mass above is >= p.
        probs = jax.nn.softmax(logits, axis=-1)
        above = _largest(lambda u: jnp.sum(jnp.where(keys > u[:, None], probs, 0), axis=-1) >= sb.top_p, keys.shape[0])
        return jnp.where((keys > above[:, None]) | (sb.top_p[:, None] >= 1), logits, -jnp.inf)

    logits = jax.lax.cond(jnp.any(sb.top_p < 1), top_p, lambda logits: logits, logits)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.where(p < sb.min_p[:, None] * p.max(axis=-1, keepdims=True), -jnp.inf, logits)


def _argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` of rows `x` [R, V] -> [R] int32 (the first largest value, or
    the first NaN), as two plain reductions: XLA:CPU runs them in half of argmax's time."""
    top = jnp.max(x, axis=-1, keepdims=True)
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-0.0 as 0.0; every number's key is above 0)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _largest(holds: Callable[[jax.Array], jax.Array], num_rows: int) -> jax.Array:
    """Per row, the largest uint32 u for which `holds(u)` ([R] -> [R] bool) is true, for a
    condition true up to some u and false after it (and true at 0): fixed bit by bit."""

    def fix_bit(i, found):
        trial = found | jnp.left_shift(jnp.uint32(1), (31 - i).astype(jnp.uint32))
        return jnp.where(holds(trial), trial, found)

    return jax.lax.fori_loop(0, 32, fix_bit, jnp.zeros(num_rows, jnp.uint32))  # a loop: 32 copies compile slowly


def _per_row(seq_sb: SamplingBatch, rows: RowSettings) -> SamplingBatch:
    """The sequences' settings gathered per row (the history stays per sequence: `rows` says
    how much of it each row counts; the drafter's inputs are not sampling settings)."""
    per_row = {
        f.name: getattr(seq_sb, f.name)[rows.seq]
        for f in dataclasses.fields(seq_sb)
        if f.name
        not in (
            "history",
            "sample_rows",
            "steps",
            "next_ids",
            "following_ids",
            "wants_drafts",
            "speculates",
            "feed_rows",
            "history_feed",
            "history_ends",
        )
    }
    return dataclasses.replace(seq_sb, **per_row, steps=rows.steps)


def _choose(logits: jax.Array, sb: SamplingBatch, rows: RowSettings) -> jax.Array:
    """One token per row of `logits` [R, V] float32 under the per-row settings `sb`: bans,
    restrictions and penalties, then greedy or a draw with the row's key (seed, output index)."""
    banned = jnp.where((rows.steps < sb.min_tokens)[:, None], sb.banned, -1)
    logits = _ban(logits, banned)
    restricted = jnp.any(sb.bias_ids >= 0) | jnp.any(sb.allowed_ids >= 0) | jnp.any(sb.bad_ids >= 0)
    logits = jax.lax.cond(restricted, _restrict, lambda logits, sb: logits, logits, sb)
    # Penalties scatter every row's history over the vocabulary: only when some row has one
    # (the builder fills the histories under the same condition: `sequence_settings.is_penalised`).
    penalised = (
        jnp.any(sb.repetition_penalty != 1) | jnp.any(sb.frequency_penalty != 0) | jnp.any(sb.presence_penalty != 0)
    )
    logits = jax.lax.cond(penalised, _apply_penalties, lambda logits, sb, rows: logits, logits, sb, rows)
    greedy = _argmax(logits)
    temp = jnp.where(sb.temperature > 0, sb.temperature, 1.0)

    def noise(seed: jax.Array, step: jax.Array) -> jax.Array:  # [V]: what `jax.random.categorical` adds
        return jax.random.gumbel(jax.random.fold_in(jax.random.key(seed), step), logits.shape[-1:])

    def sample(scaled: jax.Array) -> jax.Array:  # [R, V] -> [R]: categorical's draw, argmax(logits + noise)
        return _argmax(_filter(scaled, sb) + jax.vmap(noise)(sb.seeds, sb.steps))

    # The filters search the vocabulary and the draw makes V random numbers per row: skip
    # both when every row is greedy.
    drawn = jax.lax.cond(jnp.any(sb.temperature > 0), sample, lambda scaled: greedy, logits / temp[:, None])
    return jnp.where(sb.temperature > 0, drawn, greedy).astype(jnp.int32)


def sample_tokens(logits: jax.Array, seq_sb: SamplingBatch, num_logprobs: int) -> SampleOutput:
    """Samples one token per sample row of `logits` [S * W, V] (row j of sequence i at
    i * W + j) under its sequence's settings."""
    num_seqs, width = seq_sb.sample_rows.shape
    rows = row_settings(seq_sb)
    sb = _per_row(seq_sb, rows)
    logits = jnp.asarray(logits, jnp.float32)
    # A grammar's mask comes first, before log-probabilities too (as vLLM applies it).
    logits = jax.lax.cond(jnp.any(sb.constrained), _grammar, lambda logits, sb: logits, logits, sb)
    tokens = _choose(logits, sb, rows)

    def top(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        logprobs = jax.nn.log_softmax(logits, axis=-1)  # raw: before any setting but a grammar
        chosen = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
        rank, values, ids = _top_and_rank(logprobs, chosen, num_logprobs)
        return chosen, values, ids, rank

    def none(logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        rows = logits.shape[0]
        zeros = jnp.zeros((rows, num_logprobs), jnp.int32)
        return jnp.zeros((rows,), jnp.float32), zeros.astype(jnp.float32), zeros, jnp.zeros((rows,), jnp.int32)

    chosen, top_logprobs, top_ids, rank = jax.lax.cond(jnp.any(sb.wants_logprobs), top, none, logits)
    by_seq = lambda a: a.reshape(num_seqs, width, *a.shape[1:])  # noqa: E731
    return SampleOutput(by_seq(tokens), by_seq(chosen), by_seq(top_logprobs), by_seq(top_ids), by_seq(rank))


def fed(batch: StepBatch, sb: SamplingBatch, feed: jax.Array) -> tuple[StepBatch, SamplingBatch]:
    """The step's token ids with the tokens the host has not read taken from the previous
    step's `feed` [F] (`SamplingBatch.feed_rows`), and the tokens that end the histories
    (`history_feed` -> `history_ends`). The histories themselves are left alone: only penalties
    read them, and put those tokens in (`_history`), so a step without penalties copies none."""
    ids = jnp.where(sb.feed_rows >= 0, feed[jnp.maximum(sb.feed_rows, 0)], batch.input_ids)
    ends = jnp.where(sb.history_feed >= 0, feed[jnp.maximum(sb.history_feed, 0)], -1)
    return dataclasses.replace(batch, input_ids=ids), dataclasses.replace(sb, history_ends=ends)


def feed_of(tokens: jax.Array, size: int) -> jax.Array:
    """A step's `SampleOutput.feed`: each sequence's last sample row's token [S, W] -> [size]
    (what a plain step samples; a step whose tokens are fed on never verifies drafts)."""
    return jnp.zeros(size, jnp.int32).at[: tokens.shape[0]].set(tokens[:, -1])


def draft_tokens(logits: jax.Array, seq_sb: SamplingBatch, last: jax.Array, i: int | jax.Array) -> jax.Array:
    """Each sequence's draft after its last accepted row `last` [S] and `i` drafts before it,
    from the draft's `logits` [S, V]: chosen as the target will choose that output index next
    step, with the same settings and the same key, so the same Gumbel noise (`categorical`
    draws argmax(logits + gumbel(key))). Where the draft's distribution is the target's the
    two draws agree, so a sampled request keeps its drafts as a greedy one does, and the
    verify step's rule (keep drafts while they equal the target's own draw) is unchanged:
    outputs are the target's draws, the same tokens as without speculation. The draft's
    penalties count the history up to its last accepted row only (an approximation: it can
    cost acceptance, never exactness). -> [S] int32"""
    num_seqs, width = seq_sb.sample_rows.shape
    at = jnp.arange(num_seqs) * width + last
    verify_rows = row_settings(seq_sb)
    rows = RowSettings(
        jnp.arange(num_seqs, dtype=jnp.int32), verify_rows.steps[at] + 1 + i, verify_rows.history_lens[at]
    )
    return _choose(jnp.asarray(logits, jnp.float32), _per_row(seq_sb, rows), rows)
