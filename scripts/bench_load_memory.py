"""Peak memory while loading a model into its tensor-parallel shards, from Hugging Face
safetensors and from jaxengine's Orbax store.

    python scripts/bench_load_memory.py [--model DIR | --random-bamba] [--dtype float32] \
        [--tp 1 2 4 8] [--json OUT.json]

Each (source, tensor-parallel size) loads in a fresh process on eight fake CPU devices as the
engine does: `load_model` with the engine's placement, then every parameter put into its
shards. Reported per load: the model's bytes, device 0's bytes of parameters afterwards, and
the process's peak resident memory above what it held just before loading. On CPU the devices'
memory is the host's, so that peak counts host copies and every device's shards together:
about 1x the model when nothing is copied twice, 2x where the host holds the whole model
while the shards are made. On an accelerator the devices' own peak
(`memory_stats()["peak_bytes_in_use"]`) is reported as well.

`--random-bamba` loads the seeded random Bamba of `bench_throughput.py` (35M parameters; needs
torch): large enough to stand out of the process's own memory, which the embedded default
model (2.9M parameters) is not.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def child(model_dir: str, tp: int, dtype: str) -> dict:
    """One load in this process (started by `main` with eight CPU devices)."""
    import jax

    from jaxengine.engine.mesh import Parallelism, axis_rules
    from jaxengine.engine.runner import place_params
    from jaxengine.models.arch import load_model_config
    from jaxengine.models.loader import load_model

    parallelism = Parallelism(tp)
    cfg = load_model_config(Path(model_dir))
    parallelism.validate(cfg)
    mesh = parallelism.mesh()
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) starts again from here
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    cfg, _, params = load_model(model_dir, dtype, place=parallelism.placement(cfg))
    placed = jax.block_until_ready(place_params(params, mesh, axis_rules(cfg, mesh))[0])
    seconds = time.perf_counter() - start
    del params
    device0 = jax.devices()[0]
    stats = device0.memory_stats()
    return {
        "model_bytes": sum(x.nbytes for x in placed),
        "device0_bytes": sum(s.data.nbytes for x in placed for s in x.addressable_shards if s.device == device0),
        "peak_above_start_bytes": (_status_kib("VmHWM") - before) * 1024,
        "device0_peak_bytes": stats.get("peak_bytes_in_use") if stats else None,
        "seconds": seconds,
    }


def _run_child(model_dir: Path, tp: int, dtype: str) -> dict:
    env = dict(os.environ)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(model_dir), str(tp), dtype], env=env, capture_output=True, text=True
    )
    if out.returncode:  # e.g. a size the model's heads refuse: its ValueError's message
        return {"error": (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded default model)")
    parser.add_argument("--random-bamba", action="store_true", help="bench_throughput.py's random 35M Bamba")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", nargs=3, metavar=("DIR", "TP", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), args.child[2])))
        return

    from jaxengine.cli import main as cli_main
    from jaxengine.run_config import DEFAULT_MODEL

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model or DEFAULT_MODEL)
        if args.random_bamba:
            sys.path.insert(0, str(Path(__file__).parent))
            import bench_throughput

            model = Path(tmp) / "random-bamba"
            bench_throughput.build_random_model(model, "bamba")
        converted = Path(tmp) / "converted"
        cli_main(["convert", str(model), str(converted), "--dtype", args.dtype])
        rows = [
            {"source": source, "tp": tp, **_run_child(path, tp, args.dtype)}
            for source, path in (("safetensors", model), ("orbax", converted))
            for tp in args.tp
        ]
    print(
        f"{'source':<12} {'TP':>3} {'model MiB':>10} {'device 0 MiB':>13} {'peak above start MiB':>21} "
        f"{'peak / model':>13} {'load s':>7}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['source']:<12} {r['tp']:>3} {r['error']}")
            continue
        print(
            f"{r['source']:<12} {r['tp']:>3} {r['model_bytes'] / MIB:>10.1f} {r['device0_bytes'] / MIB:>13.1f} "
            f"{r['peak_above_start_bytes'] / MIB:>21.1f} {r['peak_above_start_bytes'] / r['model_bytes']:>13.2f} "
            f"{r['seconds']:>7.2f}"
        )
    if args.json:
        name = "bench_throughput.py's random Bamba" if args.random_bamba else str(args.model or DEFAULT_MODEL)
        Path(args.json).write_text(json.dumps({"model": name, "dtype": args.dtype, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
