"""What each compiled step shape costs to compile and to run, and which buy nothing.

    python scripts/bench_shapes.py [--model DIR] [--repeats 20] [--json OUT.json]

The engine compiles one executable per step shape (`batch_builder.BatchBuilder.shapes`): token
buckets x sequence buckets for mixed steps, sequence buckets x checkpoint-save buckets for
decode steps. A shape *buys nothing* when the steps it serves would run as fast in the next
shape up: the cheapest other shape that covers it (`Shape.covers`, the one a step falls back
to) runs within `--margin` (5%) of its time. Dropping such a shape saves its compile and costs
no step time.

The engine (the embedded default model unless `--model`) is built at its defaults (the
model's own `max_model_len`, `max_num_seqs` 16), every shape compiled before timing and none
stored. Each shape runs an all-padding batch
(`BatchBuilder.empty`, what warm-up runs): the cost of the shape itself, the same whatever the
batch holds for the matmuls, a lower bound for kernels whose work follows the real tokens.
Shapes are timed in rounds, each round every shape once in a shuffled order, and each shape's
median taken, so the machine's drift falls on all of them alike.

Only a device shows what a shape costs there: on a CPU a step's time follows its tokens, so
every bucket buys its share; on an accelerator the small buckets of a step bound by reading
the weights may cost the same (`scripts/device_check.py` runs this for the GPU).
"""

import argparse
import json
import random
import statistics
import time

import jax

from jaxengine import LLM
from jaxengine.engine.batch_builder import Shape
from jaxengine.run_config import DEFAULT_MODEL

MARGIN = 0.05


def shape_costs(llm: LLM, repeats: int, seed: int = 0) -> dict[Shape, float]:
    """Median seconds of one step of each shape, timed in `repeats` shuffled rounds."""
    engine = llm.engine
    batches = {shape: engine.builder.empty(shape) for shape in engine.shapes()}
    times: dict[Shape, list[float]] = {shape: [] for shape in batches}
    order = list(batches)
    rng = random.Random(seed)
    for _ in range(repeats + 1):
        rng.shuffle(order)
        for shape in order:
            batch, sampling = batches[shape]
            start = time.perf_counter()
            jax.block_until_ready(engine.runner.sample(batch, sampling, shape.decode).tokens)
            times[shape].append(time.perf_counter() - start)
    return {shape: statistics.median(t[1:]) for shape, t in times.items()}  # the first round: warm-up


def fallback(shape: Shape, shapes: list[Shape]) -> Shape | None:
    """The cheapest other shape a step of `shape` fits (None: it is the only one)."""
    fits = [s for s in shapes if s != shape and s.covers(shape)]
    return min(fits, key=lambda s: s.size, default=None)


def report(costs: dict[Shape, float], compile_s: dict[tuple, float], margin: float) -> list[dict]:
    """One row per shape, cheapest first: its step time, its fallback's, and whether it buys
    nothing (the fallback within `margin`)."""
    shapes = sorted(costs, key=lambda s: s.size)
    rows = []
    for shape in shapes:
        up = fallback(shape, shapes)
        ratio = costs[up] / costs[shape] if up is not None else None
        rows.append(
            {
                "shape": f"{'decode' if shape.decode else 'mixed'} T={shape.num_tokens} S={shape.num_seqs} "
                f"saves={shape.num_saves}",
                "step_ms": 1e3 * costs[shape],
                "compile_s": compile_s.get(shape.key),
                "fallback": None if up is None else f"T={up.num_tokens} S={up.num_seqs} saves={up.num_saves}",
                "fallback_ratio": ratio,
                "buys_nothing": ratio is not None and ratio <= 1 + margin,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a model directory (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--margin", type=float, default=MARGIN)
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    llm = LLM(model=args.model, background_compile=False, compilation_cache_dir=None)
    compile_s = dict(llm.engine.runner.steps.compile_seconds)
    rows = report(shape_costs(llm, args.repeats), compile_s, args.margin)
    for r in rows:
        ratio = "-" if r["fallback_ratio"] is None else f"{r['fallback_ratio']:.2f}"
        compiled = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
        print(
            f"{r['shape']:34s} step {r['step_ms']:7.2f} ms  compile {compiled:>5s} s  "
            f"fallback {r['fallback'] or '-':24s} x{ratio}{'  buys nothing' if r['buys_nothing'] else ''}"
        )
    nothing = [r for r in rows if r["buys_nothing"]]
    saved = sum(r["compile_s"] or 0.0 for r in nothing)
    print(f"{len(nothing)} of {len(rows)} shapes buy nothing (within {args.margin:.0%}); their compiles: {saved:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(jax.devices()[0]), "rows": rows}, f, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
