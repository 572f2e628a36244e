"""Load time of a model from its Hugging Face safetensors vs from jaxengine's Orbax store.

    python scripts/bench_load.py [--model DIR] [--repeats 5] [--json OUT.json]

Converts the model (default: the embedded one) into a temporary directory, then times
`load_model` from each source alternately in fresh state (best of N) and checks that both
give bit-identical parameters.
"""

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jaxengine.cli import main as cli_main
from jaxengine.models.loader import load_model
from jaxengine.run_config import DEFAULT_MODEL


def _time_load(path: Path, dtype: str) -> tuple[float, list[np.ndarray]]:
    start = time.perf_counter()
    _, _, state = load_model(path, dtype)
    leaves = jax.block_until_ready(jax.tree.leaves(state))
    return time.perf_counter() - start, [np.asarray(x) for x in leaves]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        converted = Path(tmp) / "converted"
        cli_main(["convert", args.model, str(converted), "--dtype", args.dtype])
        _time_load(Path(args.model), args.dtype)  # first call pays imports and tracing
        times = {"safetensors": [], "orbax": []}
        for _ in range(args.repeats):
            t_hf, hf_leaves = _time_load(Path(args.model), args.dtype)
            t_ob, ob_leaves = _time_load(converted, args.dtype)
            times["safetensors"].append(t_hf)
            times["orbax"].append(t_ob)
        identical = all(np.array_equal(a, b) for a, b in zip(hf_leaves, ob_leaves))
    best = {k: min(v) for k, v in times.items()}
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "best_s": best,
        "orbax_speedup": best["safetensors"] / best["orbax"],
        "bit_identical": identical,
        "repeats": args.repeats,
    }
    print(f"{'source':<12} {'best load (s)':>14}")
    for k, v in best.items():
        print(f"{k:<12} {v:>14.3f}")
    print(f"orbax is {result['orbax_speedup']:.2f}x faster; parameters bit-identical: {identical}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
