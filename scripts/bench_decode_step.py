"""jaxengine's decode step time alone, on the random Bamba of `bench_throughput.py`: for
comparing two versions of the engine (run it in each tree, alternating).

Builds the model once in --model-dir (the same seeded weights as `bench_throughput.py`),
compiles each step fresh (`compilation_cache_dir=None`, so a version never runs executables
another one stored), runs two untimed generate calls per batch size, then reports the median
over three calls of the mean time per output token (128-token prompts, 64 greedy tokens).

Usage: python scripts/bench_decode_step.py [--model-dir /tmp/bench_bamba] [--batch-sizes 1 16]
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import bench_throughput  # noqa: E402

from jaxengine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/bench_bamba"))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    if not (args.model_dir / "config.json").is_file():
        bench_throughput.build_random_model(args.model_dir, "bamba")
    llm = LLM(args.model_dir, compilation_cache_dir=None, warm_up=False)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    for batch in args.batch_sizes:

        def prompts() -> list[list[int]]:
            return [rng.integers(1, 8192, 128).tolist() for _ in range(batch)]  # noqa: B023

        for _ in range(2):
            llm.generate(prompts(), params, use_tqdm=False)
        tpot = [
            statistics.mean(o.time_per_output_token for o in llm.generate(prompts(), params, use_tqdm=False))
            for _ in range(3)
        ]
        print(f"batch {batch}: {statistics.median(tpot) * 1e3:.2f} ms per output token")


if __name__ == "__main__":
    main()
