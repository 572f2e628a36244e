"""Which parts of a decode step grow with `max_model_len` rather than with the context used.

Times, at several `max_model_len` values and one fixed real context, each part of a step whose
array shapes carry `max_model_len` (the page table's width, the sampler's token history):
the attention reference over the page table, the sampler with and without penalties, and the
host-side building of one step's arrays. The shapes are those of ``scripts/bench_throughput.py``
at batch 16: 8 query heads over 4 KV heads of 64, pages of 16, vocabulary 8,192.

Usage: python scripts/profile_context_scaling.py [--context 192] [--lens 192 1024 4096]
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.engine.batch_builder import BatchBuilder
from jaxengine.engine.sampler import SamplingBatch, sample_tokens
from jaxengine.engine.sampling_params import MAX_STOP_TOKEN_IDS, SamplingParams
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence import Sequence
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

SEQS, Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, VOCAB = 16, 8, 4, 64, 16, 8192


def best_of(fn, *args, trials: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def attention_case(max_len: int, context: int):
    rng = np.random.default_rng(0)
    pages_per_seq = -(-max_len // PAGE)
    num_pages = 1 + SEQS * pages_per_seq
    k = jnp.asarray(rng.standard_normal((num_pages, PAGE, KV_HEADS, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((num_pages, PAGE, KV_HEADS, HEAD_DIM)), jnp.float32)
    table = np.zeros((SEQS, pages_per_seq), np.int32)
    used = -(-context // PAGE)
    table[:, :used] = 1 + np.arange(SEQS * used).reshape(SEQS, used)
    q = jnp.asarray(rng.standard_normal((SEQS, Q_HEADS, HEAD_DIM)), jnp.float32)
    kv_lens = np.full(SEQS, context, np.int32)
    cu = np.arange(SEQS + 1, dtype=np.int32)
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=HEAD_DIM**-0.5))
    return fn, (q, k, v, kv_lens, table, cu)


def sampler_case(max_len: int, context: int, penalties: bool):
    rng = np.random.default_rng(0)
    history = np.full((SEQS, max_len), -1, np.int32)
    history[:, :context] = rng.integers(0, VOCAB, (SEQS, context))
    sb = SamplingBatch(
        temperature=np.zeros(SEQS, np.float32),
        top_k=np.zeros(SEQS, np.int32),
        top_p=np.ones(SEQS, np.float32),
        min_p=np.zeros(SEQS, np.float32),
        presence_penalty=np.zeros(SEQS, np.float32),
        frequency_penalty=np.zeros(SEQS, np.float32),
        repetition_penalty=np.full(SEQS, 1.1 if penalties else 1.0, np.float32),
        seeds=np.zeros(SEQS, np.uint32),
        steps=np.zeros(SEQS, np.int32),
        history=history,
        history_lens=np.full(SEQS, context, np.int32),
        prompt_lens=np.full(SEQS, context // 2, np.int32),
        banned=np.full((SEQS, MAX_STOP_TOKEN_IDS), -1, np.int32),
        min_tokens=np.zeros(SEQS, np.int32),
        wants_logprobs=np.zeros(SEQS, bool),
        bias_ids=np.full((SEQS, 1), -1, np.int32),
        bias_values=np.zeros((SEQS, 1), np.float32),
        allowed_ids=np.full((SEQS, 1), -1, np.int32),
        bad_ids=np.full((SEQS, 1), -1, np.int32),
        grammar_mask=np.zeros((SEQS, -(-VOCAB // 32)), np.int32),
        constrained=np.zeros(SEQS, bool),
        sample_rows=np.arange(SEQS, dtype=np.int32)[:, None],
        num_drafts=np.zeros(SEQS, np.int32),
        next_ids=np.full(SEQS, -1, np.int32),
        following_ids=np.full(SEQS, -1, np.int32),
        wants_drafts=np.zeros(SEQS, bool),
        speculates=np.zeros(SEQS, bool),
        feed_rows=np.full(SEQS, -1, np.int32),
        history_feed=np.full(SEQS, -1, np.int32),
        history_ends=np.full(SEQS, -1, np.int32),
    )
    logits = jnp.asarray(rng.standard_normal((SEQS, VOCAB)), jnp.float32)
    return jax.jit(functools.partial(sample_tokens, num_logprobs=20)), (logits, sb)


def host_build_s(max_len: int, context: int) -> float:
    builder = BatchBuilder(
        max_num_batched_tokens=512,
        max_num_seqs=SEQS,
        max_model_len=max_len,
        page_size=PAGE,
        eos_token_ids=(0,),
        vocab_size=VOCAB,
    )
    seqs = []
    for i in range(SEQS):
        seq = Sequence(str(i), i, list(range(1, context + 1)), context - 64, SamplingParams(max_tokens=64), seed=i)
        seq.num_computed = context - 1
        seq.pages = list(range(1 + i * 16, 1 + i * 16 + -(-context // PAGE)))
        seqs.append(seq)
    step = ScheduledStep(seqs, [1] * SEQS)
    start = time.perf_counter()
    for _ in range(200):
        builder.build(step)
    return (time.perf_counter() - start) / 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=192, help="context tokens each sequence really has")
    parser.add_argument("--lens", type=int, nargs="+", default=[192, 1024, 4096], help="max_model_len values")
    args = parser.parse_args()
    print(f"batch {SEQS} decode, real context {args.context} tokens; best of 20, ms")
    print(f"| {'max_model_len':>13} | attention | sampler, no penalties | sampler, repetition 1.1 | host build |")
    print("|---:|---:|---:|---:|---:|")
    for max_len in args.lens:
        attention_fn, attention_args = attention_case(max_len, args.context)
        attention = best_of(attention_fn, *attention_args)
        plain_fn, plain_args = sampler_case(max_len, args.context, penalties=False)
        pen_fn, pen_args = sampler_case(max_len, args.context, penalties=True)
        plain = best_of(plain_fn, *plain_args)
        penalised = best_of(pen_fn, *pen_args)
        host = host_build_s(max_len, args.context)
        print(
            f"| {max_len:>13} | {attention * 1e3:.3f} | {plain * 1e3:.3f} | {penalised * 1e3:.3f} | {host * 1e3:.3f} |"
        )


if __name__ == "__main__":
    main()
