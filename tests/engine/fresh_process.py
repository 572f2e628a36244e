"""A small Python program run in a fresh process, for tests whose claim is about a process of
its own (what it compiles, loads or keeps), away from what the test worker has done before."""

import subprocess
import sys


def last_line(program: str, *args: str, env: dict[str, str] | None = None) -> str:
    """The last line `python -c program *args` printed (it must exit cleanly, within 10 minutes)."""
    run = subprocess.run(
        [sys.executable, "-c", program, *args], env=env, check=True, capture_output=True, text=True, timeout=600
    )
    return run.stdout.strip().splitlines()[-1]
