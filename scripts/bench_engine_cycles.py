"""Memory of a process that creates, uses and frees engines in turn (a notebook, a sweep).

    python scripts/bench_engine_cycles.py [--cycles 50] [--model DIR] [--engine-args '{...}'] \
        [--release del|shutdown|with] [--json OUT.json]

Each cycle creates an `LLM` of the model (default: the embedded default model) with the
defaults and `--engine-args`, generates one short request, and frees it (`del llm` and
`gc.collect()`, `llm.shutdown()`, or a `with` block). After each cycle it prints the process's
memory mappings (`/proc/self/maps`: XLA:CPU maps each compiled step's code), its resident
memory, the cycle's seconds and the step executables the process keeps for later engines;
at the end, the last cycle's mappings and resident memory against the first's.
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxengine import LLM, SamplingParams  # noqa: E402
from jaxengine.engine import step_store  # noqa: E402
from jaxengine.run_config import DEFAULT_MODEL  # noqa: E402


def memory() -> tuple[int, float]:
    """(memory mappings, resident MiB) of this process."""
    maps = len(Path("/proc/self/maps").read_text().splitlines())
    rss = next(
        int(line.split()[1]) for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS:")
    )
    return maps, rss / 1024


def cycle(model: str, args: dict, release: str) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0)
    if release == "with":
        with LLM(model, **args) as llm:
            llm.generate(["The quick brown fox"], params, use_tqdm=False)
        return
    llm = LLM(model, **args)
    llm.generate(["The quick brown fox"], params, use_tqdm=False)
    if release == "shutdown":
        llm.shutdown()
    del llm
    gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--engine-args", type=json.loads, default={})
    parser.add_argument("--release", choices=("del", "shutdown", "with"), default="del")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    print("cycle  maps  resident MiB  seconds  kept steps", flush=True)
    for i in range(args.cycles):
        start = time.perf_counter()
        cycle(args.model, args.engine_args, args.release)
        maps, rss = memory()
        rows.append(dict(cycle=i, maps=maps, resident_mib=round(rss, 1), seconds=round(time.perf_counter() - start, 2)))
        print(f"{i:5d} {maps:5d} {rss:13.1f} {rows[-1]['seconds']:8.2f} {step_store.num_kept_steps():11d}", flush=True)
    first, last = rows[0], rows[-1]
    summary = dict(
        maps_last_over_first=round(last["maps"] / first["maps"], 3),
        resident_last_over_first=round(last["resident_mib"] / first["resident_mib"], 3),
        max_maps=max(r["maps"] for r in rows),
        max_resident_mib=max(r["resident_mib"] for r in rows),
    )
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(
            json.dumps(dict(args=vars(args) | {"json": str(args.json)}, cycles=rows, summary=summary), indent=1)
        )


if __name__ == "__main__":
    main()
