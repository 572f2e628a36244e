"""The prefix-cache replay of this checkout against an earlier revision of itself: the seconds
the engine's bookkeeping takes over a trace and the process's peak memory, with the two
versions' hits compared request by request (a change meant to leave them alone must).

Each version runs `scripts/replay_prefix_trace.py` with the arguments after `--` in processes
of its own (the revision from a `git worktree` of it), the two taking turns `--pairs` times so
that the machine's drift falls on both alike. Reported: the median replay seconds of each (the
script's own timing: bookkeeping only, not loading the trace), the median of the per-pair
speed-ups (the revision's seconds over this checkout's), the peak resident memory of each
process (loading included), and whether every request's hit agrees.

    python scripts/bench_replay_against_revision.py --revision 6cb8596 [--pairs 2] [--json OUT] \
        -- TRACE.jsonl --format mooncake --block-tokens 16 --model-config DIR --budget-bytes 10e9
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from revision_worktree import REPO, revision_worktree


def run_replay(source: Path, replay_args: list[str], out: Path) -> dict:
    """One replay by the version at `source`: its seconds, peak memory (MiB) and hits."""
    cmd = [sys.executable, str(source / "scripts" / "replay_prefix_trace.py"), *replay_args, "--json", str(out)]
    proc = subprocess.Popen(
        cmd, env={**os.environ, "PYTHONPATH": str(source)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if status:
        raise SystemExit(f"the replay at {source} failed:\n{stderr.decode()[-4000:]}")
    result = json.loads(out.read_text())
    return {
        "seconds": result["settings"]["seconds"],
        "peak_mib": usage.ru_maxrss / 1024,  # kilobytes on Linux
        "hits": [r["hit_tokens"] for r in result["per_request"]],
        "token_hit_rate": result["token_hit_rate"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--revision", required=True, help="a git revision of this repository")
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("replay_args", nargs=argparse.REMAINDER, help="-- then replay_prefix_trace.py's arguments")
    args = parser.parse_args()
    replay_args = args.replay_args[1:] if args.replay_args[:1] == ["--"] else args.replay_args
    if not replay_args:
        parser.error("give replay_prefix_trace.py's arguments after --")
    # The versions run in their own directories: paths that exist here are passed whole.
    replay_args = [str(Path(a).resolve()) if not a.startswith("-") and Path(a).exists() else a for a in replay_args]
    with revision_worktree(args.revision) as base, tempfile.TemporaryDirectory() as tmp:
        sources = {"this checkout": REPO, args.revision: base}
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        for pair in range(args.pairs):
            for name in list(sources) if pair % 2 == 0 else list(sources)[::-1]:
                out = Path(tmp) / f"replay-{pair}-{list(sources).index(name)}.json"
                runs[name].append(run_replay(sources[name], replay_args, out))
            print(
                f"pair {pair}: " + ", ".join(f"{n} {runs[n][-1]['seconds']:.1f} s" for n in sources),
                flush=True,
            )
    ours, theirs = runs["this checkout"], runs[args.revision]
    results = {
        "this_checkout_seconds": statistics.median(r["seconds"] for r in ours),
        "revision_seconds": statistics.median(r["seconds"] for r in theirs),
        "speed_up": statistics.median(b["seconds"] / a["seconds"] for a, b in zip(ours, theirs)),
        "this_checkout_peak_mib": max(r["peak_mib"] for r in ours),
        "revision_peak_mib": max(r["peak_mib"] for r in theirs),
        "token_hit_rate": ours[0]["token_hit_rate"],
        "hits_identical": all(r["hits"] == theirs[0]["hits"] for r in ours + theirs),
    }
    print(
        f"replay: this checkout {results['this_checkout_seconds']:.1f} s, {args.revision} "
        f"{results['revision_seconds']:.1f} s, speed-up {results['speed_up']:.2f}x (median of {args.pairs} pairs); "
        f"peak memory {results['this_checkout_peak_mib']:.0f} / {results['revision_peak_mib']:.0f} MiB; "
        f"token hit rate {results['token_hit_rate']:.4f}, every request's hit the same: {results['hits_identical']}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({**vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
