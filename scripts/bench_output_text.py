"""The host's cost of a sequence's text, by how long its output already is: handing it a sampled
token when it has stop strings (`OutputProcessor.append`: the stop check), and its text so far
after that token (`OutputProcessor.decode`, what a stream asks for after every step); this
checkout against an earlier revision.

The sequence's output is the tokens of an English text from the embedded default model's
tokenizer, its stop strings two that never occur in it ("<|stop|>", "\\n\\n\\n"), so it runs to
the longest length asked. At each length, the median microseconds of each of the two over the
`--window` tokens before it. Each version runs in processes of its own (the revision from a
`git worktree` of it), the two taking turns `--pairs` times; reported: each version's median
and the median of the per-pair ratios (this checkout over the revision).

    python scripts/bench_output_text.py --revision aeb2747 [--lengths 100 1000 4000] [--pairs 3]
"""

import argparse
import statistics

from revision_worktree import median_ratio, worker_turns

# Runs under either version: the output processor, the sequence and the sampling parameters.
WORKER = """
import json, statistics, sys, time
from transformers import AutoTokenizer
from jaxengine.engine.output_processor import OutputProcessor
from jaxengine.engine.sampling_params import SamplingParams
from jaxengine.engine.sequence import Sequence
from jaxengine.run_config import DEFAULT_MODEL

window, *lengths = map(int, sys.argv[1:])
tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
words = "the engine reads each token as it comes and checks whether the text ends a stop string; "
ids = tokenizer.encode(words * (max(lengths) // 8 + 1), add_special_tokens=False)[: max(lengths)]
params = SamplingParams(stop=["<|stop|>", "\\n\\n\\n"], max_tokens=len(ids) + 1, ignore_eos=True)
seq = Sequence("r", 0, [1, 2, 3], 3, params, seed=0)
processor = OutputProcessor(tokenizer, eos_token_ids=())
append, decode = [], []
for token in ids:
    start = time.perf_counter()
    processor.append(seq, token, None)
    appended = time.perf_counter()
    processor.decode(seq)
    append.append(appended - start)
    decode.append(time.perf_counter() - appended)
assert seq.finish_reason is None, "a stop string matched: the benchmark's text must not hold one"
print("RESULT " + json.dumps({n: [statistics.median(t[n - window : n]) * 1e6 for t in (append, decode)] for n in lengths}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="a git revision of this repository")
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 4000])
    parser.add_argument("--window", type=int, default=50, help="appends timed before each length")
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    worker_args = [str(args.window), *map(str, args.lengths)]
    times = worker_turns(args.revision, args.pairs, WORKER, worker_args)
    for n in args.lengths:
        for part, what in enumerate(("the stop check (append)", "the text so far (decode)")):
            ours, theirs = ([t[n][part] for t in times[name]] for name in times)
            ratio = median_ratio(ours, theirs)
            print(
                f"output length {n}, {what}: this checkout {statistics.median(ours):.1f} µs a token, "
                f"{args.revision} {statistics.median(theirs):.1f} µs, ratio {ratio:.3f} (median of {args.pairs} pairs)"
            )


if __name__ == "__main__":
    main()
