"""The host's cost of building a decode step's arrays (`BatchBuilder.build`), by batch size:
this checkout against an earlier revision of itself.

The step is synthetic and the same in both versions, with the embedded default model's
settings at the engine's defaults (`max_model_len` 2,048, page size 16, a checkpoint of 18
cache blocks, vocabulary 4,096, checkpoint saves on): N sequences of 300 tokens (sampling at
temperature 0.7, top-p 0.9), each decoding its last token, 19 pages each. Batch 16 is the
default `max_num_seqs`; larger batches are built as with `max_num_seqs` raised to N (tuned
past the defaults). Each version runs in processes of its own (the revision from a `git
worktree` of it), the two taking turns `--pairs` times; a process times `--builds` builds per
batch size after a warm-up and reports the median of five such rounds. Reported: each
version's median milliseconds per build, and the median of the per-pair ratios (this checkout
over the revision).

    python scripts/bench_batch_builder.py --revision c788f1f [--batch-sizes 16 64 256] [--pairs 4]
"""

import argparse
import statistics

from revision_worktree import median_ratio, worker_turns

# Runs under either version: only the builder, the sequence and the sampling parameters.
WORKER = """
import json, statistics, sys, time
from jaxengine.engine.batch_builder import BatchBuilder
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.scheduler import ScheduledStep
from jaxengine.engine.sequence import Sequence

builds, *batches = map(int, sys.argv[1:])
result = {}
for n in batches:
    builder = BatchBuilder(
        max_num_batched_tokens=max(512, n), max_num_seqs=max(16, n), max_model_len=2048, page_size=16,
        eos_token_ids=(0,), vocab_size=4096, blocks_per_checkpoint=18, saves_checkpoints=True, recurrent=True,
    )
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", i, list(range(300)), 100, SamplingParams(temperature=0.7, top_p=0.9), seed=i)
        seq.num_computed, seq.pages = 299, list(range(i * 20, i * 20 + 19))
        seqs.append(seq)
    step = ScheduledStep(seqs, [1] * n)
    shape = builder.shape_of(step)
    for _ in range(builds):
        builder.build(step, shape)  # warm-up
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(builds):
            builder.build(step, shape)
        rounds.append((time.perf_counter() - start) / builds * 1e3)
    result[n] = statistics.median(rounds)
print("RESULT " + json.dumps(result))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="a git revision of this repository")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--builds", type=int, default=200, help="builds per timed round")
    args = parser.parse_args()
    worker_args = [str(args.builds), *map(str, args.batch_sizes)]
    times = worker_turns(args.revision, args.pairs, WORKER, worker_args)
    for n in args.batch_sizes:
        ours, theirs = ([t[n] for t in times[name]] for name in times)
        ratio = median_ratio(ours, theirs)
        print(
            f"batch {n}: this checkout {statistics.median(ours):.3f} ms a build, {args.revision} "
            f"{statistics.median(theirs):.3f} ms, ratio {ratio:.2f} (median of {args.pairs} pairs)"
        )


if __name__ == "__main__":
    main()
