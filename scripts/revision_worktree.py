"""A checkout of an earlier revision of this repository, for benchmarks that run it beside this one."""

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
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
