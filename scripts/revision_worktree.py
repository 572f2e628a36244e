"""A checkout of an earlier revision of this repository, for benchmarks that run it beside this one."""

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def revision_worktree(revision: str) -> Iterator[Path]:
    """A detached `git worktree` of `revision` in a temporary directory, removed afterwards.
    A process runs that version with the worktree first on its `PYTHONPATH`."""
    with tempfile.TemporaryDirectory(prefix="jaxengine-revision-") as tmp:
        path = Path(tmp) / "revision"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), revision], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=False)


def take_turns(sources: dict[str, Path], pairs: int, run: Callable[[str, Path], dict]) -> dict[str, list[dict]]:
    """`run(name, source)` for each version in `sources`, `pairs` times, the order reversed every
    other pair so that the machine's drift falls on both alike; prints each pair's results and
    returns each version's, in order."""
    results: dict[str, list[dict]] = {name: [] for name in sources}
    for pair in range(pairs):
        for name in list(sources) if pair % 2 == 0 else list(sources)[::-1]:
            results[name].append(run(name, sources[name]))
        print(f"pair {pair}: " + ", ".join(f"{n} {results[n][-1]}" for n in sources), flush=True)
    return results


def worker_turns(revision: str, pairs: int, code: str, args: list[str]) -> dict[str, list[dict]]:
    """`run_worker(source, code, args)` as this checkout ("this checkout") and as `revision`,
    taking turns `pairs` times (`take_turns`): each version's results, in order."""
    with revision_worktree(revision) as base:
        sources = {"this checkout": REPO, revision: base}
        return take_turns(sources, pairs, lambda name, source: run_worker(source, code, args))


def median_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of the per-pair ratios ours / theirs (pairs ran back to back, so the
    machine's drift cancels within each)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def run_worker(source: Path, code: str, args: list[str]) -> dict[int, object]:
    """Runs `python -c code *args` as the version at `source` (its directory first on the
    `PYTHONPATH`, and the working directory) and returns what the worker printed on its last
    line starting "RESULT ": a JSON object keyed by batch size. Exits, with the worker's
    error output, if it failed or printed none."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=source, capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"the worker at {source} failed:\n{out.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(lines[-1].removeprefix("RESULT ")).items()}
