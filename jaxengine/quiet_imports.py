"""Importing transformers without its notice that PyTorch is missing.

jaxengine uses transformers only for model configs and tokenizers, which need no PyTorch;
without it installed, transformers prints "PyTorch was not found. Models won't be available"
on import, which would tell a jaxengine user something untrue about jaxengine.
"""

import os

_ADVISORIES = "TRANSFORMERS_NO_ADVISORY_WARNINGS"  # transformers' own switch for such notices


def import_transformers_quietly() -> None:
    """Imports transformers with its advisory notices off, then restores the environment."""
    previous = os.environ.get(_ADVISORIES)
    os.environ[_ADVISORIES] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if previous is None:
            del os.environ[_ADVISORIES]
        else:
            os.environ[_ADVISORIES] = previous
