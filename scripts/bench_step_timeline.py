"""Where an engine step's time goes on the embedded default model, at its default settings,
with async scheduling (the default: the next step dispatched before the last one's tokens
are read) beside the synchronous loop (`async_scheduling=False`) in the same run: output
tokens/s, the host's part before dispatch, the dispatch, the wait for the device, the host's
part after, and the device's idle gap between steps (`llm.stats()`, `step_timeline.py`),
for greedy decode at several batch sizes. The two engines take turns, `--repeats` times.
Beside them, the ceiling any loop can reach: the same decode step run back to back with no
host work between (`device_only_tokens_per_s`).

    python scripts/bench_step_timeline.py [--batch-sizes 1 16] [--max-tokens 128] [--repeats 3]
"""

import argparse
import json
import statistics
import time

from jaxengine import LLM, SamplingParams
from jaxengine.run_config import DEFAULT_MODEL

KEYS = (
    "step_host_before_ms",
    "step_dispatch_ms",
    "step_device_wait_ms",
    "step_host_after_ms",
    "step_device_idle_gap_ms",
    "device_idle_fraction",
)
MODES = {"async": True, "sync": False}


def timed_run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    """One measured generate: tokens/s and the timeline of its steps only."""
    llm.engine.timeline.reset()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"output_tokens_per_s": tokens / seconds, **{k: stats[k] for k in KEYS}}


def device_only_tokens_per_s(llm: LLM, batch: int, steps: int = 100) -> float:
    """The ceiling a loop can reach: one decode step of `batch` sequences, built once, run
    `steps` times back to back (each dispatched before the last is read; no scheduling, no
    building, no token processing), in output tokens/s."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(engine.validate_request(f"x = {i}", params, "p"), params) for i in range(batch)]
    while not all(s.num_output_tokens for s in seqs):  # past their prefill
        engine.step()
    engine.drain()
    scheduled = engine.scheduler.schedule()
    shape = engine.builder.shape_of(scheduled)
    built = engine.builder.build(scheduled, shape)
    engine.runner.sample(*built, decode=shape.decode).tokens.block_until_ready()
    start = time.perf_counter()
    for _ in range(steps):
        out = engine.runner.sample(*built, decode=shape.decode)
    out.tokens.block_until_ready()
    seconds = time.perf_counter() - start
    engine.scheduler.cache.cancel_all_pending()
    for seq in seqs:
        engine.abort(seq)
    return batch * steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    # Every shape compiled before the first step (no background compile), in both engines.
    llms = {mode: LLM(DEFAULT_MODEL, background_compile=False, async_scheduling=on) for mode, on in MODES.items()}
    results = {}
    for batch in args.batch_sizes:
        prompts = [f"def function_{i}(x):" for i in range(batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        runs = {mode: [] for mode in MODES}
        for llm in llms.values():
            llm.generate(prompts, params, use_tqdm=False)  # each shape's first run
        for _ in range(args.repeats):
            for mode, llm in llms.items():
                runs[mode].append(timed_run(llm, prompts, params))
        row = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
        row["async_over_sync_tokens_per_s"] = row["async"]["output_tokens_per_s"] / row["sync"]["output_tokens_per_s"]
        row["device_only_tokens_per_s"] = device_only_tokens_per_s(llms["sync"], batch)
        results[batch] = row
        for mode in MODES:
            print(f"batch {batch} {mode}: " + ", ".join(f"{k} {v:.3f}" for k, v in row[mode].items()), flush=True)
        ceiling = row["device_only_tokens_per_s"]
        print(
            f"batch {batch}: async / sync tokens/s {row['async_over_sync_tokens_per_s']:.3f}; device only "
            f"{ceiling:.1f} tok/s: async {row['async']['output_tokens_per_s'] / ceiling:.3f} of it, sync "
            f"{row['sync']['output_tokens_per_s'] / ceiling:.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
