"""Cold start-up of the embedded default model as a user starts it, with no stored steps
(the device check's start-up part, `device_check.startup_row`): `LLM()` ready (the largest
shapes compiled), the first 16 tokens out, and every shape compiled (the rest on the
background threads), with the compile threads this machine gives. Run it under
`taskset -c 0`, `-c 0,1`, ... to see start-up against the number of cores.

    taskset -c 0 python scripts/bench_startup.py
"""

from device_check import startup_row  # this directory is on the path when run as a script

from jaxengine.engine.step_executables import background_threads, compile_threads


def main() -> None:
    row = startup_row()
    print(f"cores {compile_threads()} (background threads {background_threads()}): {row.note}")


if __name__ == "__main__":
    main()
