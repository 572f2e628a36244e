"""The prefix-cache replay's token hit rate in every cell of BENCHMARKS.md's replay tables, this
checkout beside an earlier revision: what a change to the policy gains or loses, cell by cell.

    python scripts/bench_replay_cells.py --revision 3b7080b --traces-dir DIR [--mooncake-dir DIR] \
        [--model-config configs/models/nemotron-h-7b-shape] [--groups synthetic held-out peer mooncake] \
        [--workers 2] [--json OUT]

The cells, a trace at each budget of its table (GB of KV pages and checkpoints together):
- `synthetic`: `bench_prefix_replay.py`'s agent sessions, long specification, conversations and
  few-shot traces, and the two agent traces in Mooncake's format (`--mooncake-blocks 512`);
- `held-out`: the seven agent traces the policy was not developed on (`HELD_OUT`);
- `peer`: `make_peer_traces.py`'s five workloads in other projects' shapes;
- `mooncake` (needs `--mooncake-dir`): the ten cuts of Mooncake's traces in the main table.
Traces missing from `--traces-dir` are written there. Each cell is one `replay_prefix_trace.py`
run per version, KV and states in bfloat16 as the tables count them, each in a process of its
own (`bench_replay_against_revision.run_replay`; the revision from a `git worktree`),
`--workers` at once. Printed as they come: each cell's two hit rates and the change; then per
group the mean change and the cells up and down by more than 0.05 points. The hit rates do not
depend on the machine, so the revision's column repeats the tables' figures for it.
"""

import argparse
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import tempfile
from pathlib import Path

import bench_prefix_replay
import make_peer_traces
import make_prefix_trace
from bench_replay_against_revision import run_replay
from revision_worktree import REPO, revision_worktree

GB = 1e9
HELD_OUT = {  # name -> make_prefix_trace.py agentic arguments
    "v1": "--sessions 64 --max-active 32 --seed 7",
    "v2": "--sessions 96 --max-active 16 --seed 11",
    "v3": "--sessions 48 --max-active 8 --seed 5 --tool-spec-tokens 1000",
    "v5": "--sessions 64 --max-active 24 --seed 13 --tool-result-tokens 500 2000",
    "v6": "--sessions 80 --max-active 40 --seed 17 --tool-result-tokens 50 300 --action-tokens 20 100",
    "v7": "--sessions 64 --max-active 4 --seed 19",
    "v8": "--sessions 200 --max-active 100 --seed 23 --tool-spec-tokens 3000 --turns 2 8",
}
HELD_OUT_BUDGETS = [0.5, 1, 2, 4, 8]
PEER_BUDGETS = {
    "shared-prefix": [1, 2, 4, 8],
    "shared-prefix-multiturn": [1, 2, 4, 8],
    "prefix-proportion-toolbench": [0.5, 1, 2, 4],
    "prefix-proportion-embodied": [0.25, 0.5, 1, 2],
    "chat-regenerate-edit": [0.5, 1, 2, 4],
}
MOONCAKE_CUTS = [f"conv-{k}" for k in ("0/20", "1/20", "0/10", "2/20", "7/20")] + [
    f"synth-{k}" for k in ("0/10", "1/10", "0/5", "2/10", "1/5")
]
GROUPS = ["synthetic", "held-out", "peer", "mooncake"]


@dataclasses.dataclass(frozen=True)
class Cell:
    group: str
    trace: str
    path: Path
    fmt: tuple[str, ...]  # replay_prefix_trace.py's format arguments
    gb: float

    @property
    def name(self) -> str:
        return f"{self.trace} @ {self.gb:g} GB"


def _write(path: Path, make) -> Path:
    """`make(path)` unless the trace is there already."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.redirect_stdout(io.StringIO()):
            make(path)
    return path


def _trace(kind: str, args: list[str]):
    """Writes `make_prefix_trace.py KIND PATH ARGS` when called with PATH."""
    return lambda path: make_prefix_trace.main([kind, str(path), *args])


def cells(groups: list[str], traces_dir: Path, mooncake_dir: Path | None) -> list[Cell]:
    """The cells of `groups`, their traces written into `traces_dir` where missing."""
    out = []
    if "synthetic" in groups:
        for name, (spec, budgets) in bench_prefix_replay.SYNTHETIC.items():
            path = _write(traces_dir / f"{name}.jsonl", _trace(spec[0], spec[1:]))
            out += [Cell("synthetic", name, path, (), gb) for gb in budgets]
        for name in ("agentic", "agentic-long-spec"):
            spec, budgets = bench_prefix_replay.SYNTHETIC[name]
            path = _write(
                traces_dir / f"{name}-mooncake.jsonl", _trace(spec[0], [*spec[1:], "--mooncake-blocks", "512"])
            )
            fmt = ("--format", "mooncake", "--block-tokens", "512")
            out += [Cell("synthetic", f"{name}, Mooncake's format", path, fmt, gb) for gb in budgets]
    if "held-out" in groups:
        for name, args in HELD_OUT.items():
            path = _write(traces_dir / f"{name}.jsonl", _trace("agentic", args.split()))
            out += [Cell("held-out", name, path, (), gb) for gb in HELD_OUT_BUDGETS]
    if "peer" in groups:
        if not all((traces_dir / f"{name}.jsonl").exists() for name in PEER_BUDGETS):
            with contextlib.redirect_stdout(io.StringIO()):
                make_peer_traces.main([str(traces_dir)])
        for name, budgets in PEER_BUDGETS.items():
            out += [Cell("peer", name, traces_dir / f"{name}.jsonl", (), gb) for gb in budgets]
    if "mooncake" in groups:
        if mooncake_dir is None:
            raise SystemExit("the mooncake group needs --mooncake-dir")
        for cut in MOONCAKE_CUTS:
            path, fmt, budgets = bench_prefix_replay.load(f"mooncake-{cut}", mooncake_dir, traces_dir)
            out += [Cell("mooncake", f"Mooncake {cut}", path, tuple(fmt), gb) for gb in budgets]
    return out


def replay_args(cell: Cell, model_config: Path) -> list[str]:
    budget = ["--budget-bytes", str(int(cell.gb * GB))]
    return [*bench_prefix_replay.replay_arguments(cell.path, list(cell.fmt), model_config), *budget]


def compare(
    todo: list[Cell], sources: dict[str, Path], model_config: Path, workers: int, tmp: Path
) -> dict[str, dict[str, float]]:
    """Each cell's token hit rate (%) per version of `sources` (name -> source tree, two of
    them), printing each cell's two rates and the change as both are done."""
    ours, theirs = sources
    jobs = list(enumerate((cell, name) for cell in todo for name in sources))
    rates: dict[str, dict[str, float]] = {cell.name: {} for cell in todo}

    def run(job: tuple[int, tuple[Cell, str]]) -> tuple[Cell, str, float]:
        k, (cell, name) = job
        replay = run_replay(sources[name], replay_args(cell, model_config), tmp / f"{k}.json")
        return cell, name, 100 * replay["token_hit_rate"]

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:  # each job waits on a process of its own
        for cell, name, rate in pool.map(run, jobs):
            row = rates[cell.name]
            row[name] = rate
            if len(row) == 2:
                print(
                    f"{cell.name:48s} {row[ours]:6.2f} {row[theirs]:6.2f} {row[ours] - row[theirs]:+6.2f}", flush=True
                )
    return rates


def summarize(todo: list[Cell], rates: dict[str, dict[str, float]], ours: str, theirs: str) -> dict[str, dict]:
    """Per group: cells, the mean change (points), cells up and down by more than 0.05."""
    out = {}
    for group in dict.fromkeys(cell.group for cell in todo):
        deltas = [rates[c.name][ours] - rates[c.name][theirs] for c in todo if c.group == group]
        out[group] = {
            "cells": len(deltas),
            "mean_change": sum(deltas) / len(deltas),
            "up": sum(d > 0.05 for d in deltas),
            "down": sum(d < -0.05 for d in deltas),
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="a git revision of this repository")
    parser.add_argument("--traces-dir", type=Path, required=True)
    parser.add_argument("--mooncake-dir", type=Path, help="holds Mooncake's conversation and synthetic traces")
    parser.add_argument("--model-config", type=Path, default=REPO / "configs" / "models" / "nemotron-h-7b-shape")
    parser.add_argument("--groups", nargs="+", choices=GROUPS, help="default: all (mooncake with --mooncake-dir)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    groups = args.groups or [g for g in GROUPS if g != "mooncake" or args.mooncake_dir]
    todo = cells(groups, args.traces_dir.resolve(), args.mooncake_dir)
    print(f"{'cell':48s} {'this':>6s} {args.revision[:6]:>6s} {'change':>6s}", flush=True)
    with revision_worktree(args.revision) as base, tempfile.TemporaryDirectory() as tmp:
        sources = {"this checkout": REPO, args.revision: base}
        rates = compare(todo, sources, args.model_config.resolve(), args.workers, Path(tmp))
    summary = summarize(todo, rates, "this checkout", args.revision)
    for group, s in summary.items():
        print(
            f"{group}: {s['cells']} cells, mean change {s['mean_change']:+.2f} points, {s['up']} up, {s['down']} down"
        )
    result = {"revision": args.revision, "model_config": str(args.model_config), "rates": rates, "summary": summary}
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
