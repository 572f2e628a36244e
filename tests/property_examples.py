"""How many examples a property test tries: all of its thorough count when the run asks for
more than the default tests (`-m slow`, `-m ""`) or `--hypothesis-profile=thorough`, a quarter
of it (at least two) in the default run. `conftest.py` picks the profile."""

from hypothesis import settings

settings.register_profile("thorough", max_examples=100)
settings.register_profile("default-run", max_examples=25)


def examples(thorough: int) -> int:
    return max(2, thorough * settings().max_examples // 100)
