"""Per-device bytes and all-reduce volume under tensor parallelism, from the shardings alone.

    python scripts/bench_parallel.py [--model-config configs/models/nemotron-h-7b-shape] \
        [--dtype bfloat16] [--tp 1 2 4 8] [--context-tokens 131072] [--sequences 64] [--json OUT.json]
    python scripts/bench_parallel.py --fit [--fit-models configs/models/X-shape ...] [--dtype bfloat16] \
        [--context-tokens 131072] [--sequences 64] [--json OUT.json]

No weights and no accelerator: the model's abstract parameters (shapes only) on eight fake
CPU devices, each placed by the engine's own rules (`jaxengine/engine/mesh.py`). For each
tensor-parallel size it prints device 0's share of the weights, of the KV cache for
`--context-tokens` tokens and of the live recurrent states of `--sequences` sequences, and the
all-reduce payload per token: every projection whose input dimension is split (attention's
o_proj, the MLPs' down_proj, the recurrent mixers' out_proj, ...) ends in an all-reduce of one
hidden-size vector per token; the vocabulary-split embedding adds one more.

`--fit` prints instead, for each model directory (default: every `configs/models/*-shape`), its
parameter count and device 0's weights and KV cache + live states at tensor parallel size 8, and
whether they fit one device of each 8-chip machine in `HBM_BYTES` with `HEADROOM` (10%) of its
memory left free for activations, compiled programs and fragmentation.
"""

import argparse
import glob
import json
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxengine.engine.mesh import MODEL, Parallelism, axis_rules, kv_page_sharding, param_shardings, state_sharding  # noqa: E402
from jaxengine.models.arch import load_model_config  # noqa: E402
from jaxengine.models.loader import abstract_model  # noqa: E402
from jaxengine.models.mixers import recurrent_states  # noqa: E402

GIB = 2**30
FIT_TP = 8
HBM_BYTES = {"v5e-8": 16 * GIB, "v6e-8": 32 * GIB, "8x H200": 141e9}  # one device's memory
HEADROOM = 0.10  # of a device's memory kept free


def _shard_bytes(sharding, shape: tuple[int, ...], dtype) -> int:
    return math.prod(sharding.shard_shape(shape)) * jnp.dtype(dtype).itemsize


def measure(model_dir: str, dtype: str, tp: int, context_tokens: int, sequences: int) -> dict:
    cfg = load_model_config(model_dir)
    parallelism = Parallelism(tp)
    parallelism.validate(cfg)
    mesh = parallelism.mesh()
    rules = axis_rules(cfg, mesh)
    state = nnx.split(abstract_model(cfg, jnp.dtype(dtype)))[1]
    leaves = jax.tree.leaves(state)
    shardings = param_shardings(state, mesh, rules)
    weights = sum(_shard_bytes(s, x.shape, x.dtype) for x, s in zip(leaves, shardings))
    params = sum(math.prod(x.shape) for x in leaves)
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
    # Row-parallel projections: a 2-D kernel (or an expert stack's down projection) split on its input.
    row_parallel = sum(
        1
        for x, s in zip(leaves, shardings)
        if x.ndim >= 2 and s.spec and s.spec[x.ndim - 2] == MODEL and x.shape[-1] == cfg.hidden_size
    )
    kv = 0
    if cfg.num_kv_layers:
        a = cfg.attention
        page = (1, 1, a.num_kv_heads, a.head_dim)
        kv = 2 * cfg.num_kv_layers * context_tokens * _shard_bytes(kv_page_sharding(mesh, rules, page), page, dtype)
    states = sum(
        _shard_bytes(state_sharding(mesh, rules, arr, sequences), (sequences, *arr.shape), arr.dtype(dtype))
        for arrays in recurrent_states(cfg)
        for arr in arrays
    )
    itemsize = jnp.dtype(dtype).itemsize
    return dict(
        tp=tp,
        params=params,
        weights_gib=weights / GIB,
        weights_total_gib=total / GIB,
        kv_cache_gib=kv / GIB,
        states_gib=states / GIB,
        row_parallel_projections=row_parallel,
        allreduce_bytes_per_token=(row_parallel + 1) * cfg.hidden_size * itemsize if tp > 1 else 0,
    )


def fit(model_dir: str, dtype: str, context_tokens: int, sequences: int) -> dict:
    """Device 0's share at tensor parallel size `FIT_TP`, and whether it fits each of `HBM_BYTES`."""
    r = measure(model_dir, dtype, FIT_TP, context_tokens, sequences)
    cache_gib = r["kv_cache_gib"] + r["states_gib"]
    need_bytes = (r["weights_gib"] + cache_gib) * GIB
    return dict(
        model=os.path.basename(os.path.normpath(model_dir)),
        params_b=r["params"] / 1e9,
        weights_gib=r["weights_gib"],
        cache_gib=cache_gib,
        fits={hbm: need_bytes <= (1 - HEADROOM) * hbm_bytes for hbm, hbm_bytes in HBM_BYTES.items()},
    )


def print_fit_table(rows: list[dict], dtype: str, context_tokens: int, sequences: int) -> None:
    print(
        f"TP {FIT_TP}, {dtype}; device 0's share; KV for {context_tokens} tokens, states of {sequences} sequences; "
        f"fits: weights + cache <= {1 - HEADROOM:.0%} of one device's memory"
    )
    print("| model | params (B) | weights GiB | KV + states GiB | " + " | ".join(HBM_BYTES) + " |")
    print("| --- | ---: | ---: | ---: |" + " :---: |" * len(HBM_BYTES))
    for r in rows:
        fits = " | ".join("yes" if r["fits"][hbm] else "no" for hbm in HBM_BYTES)
        print(f"| {r['model']} | {r['params_b']:.1f} | {r['weights_gib']:.2f} | {r['cache_gib']:.2f} | {fits} |")


def print_tp_table(rows: list[dict], model_dir: str, dtype: str, context_tokens: int, sequences: int) -> None:
    print(f"{model_dir}, {dtype}; device 0's share; KV for {context_tokens} tokens, states of {sequences} sequences")
    print("| TP | weights GiB | KV cache GiB | live states GiB | all-reduce bytes / token |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['tp']} | {r['weights_gib']:.2f} | {r['kv_cache_gib']:.2f} | {r['states_gib']:.3f} | "
            f"{r['allreduce_bytes_per_token']:,} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="configs/models/nemotron-h-7b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context-tokens", type=int, default=131072)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--json")
    parser.add_argument("--fit", action="store_true", help="print the fit table of --fit-models instead")
    parser.add_argument("--fit-models", nargs="+", default=sorted(glob.glob("configs/models/*-shape")))
    args = parser.parse_args()
    if args.fit:
        rows = [fit(d, args.dtype, args.context_tokens, args.sequences) for d in args.fit_models]
        print_fit_table(rows, args.dtype, args.context_tokens, args.sequences)
    else:
        rows = [measure(args.model_config, args.dtype, tp, args.context_tokens, args.sequences) for tp in args.tp]
        print_tp_table(rows, args.model_config, args.dtype, args.context_tokens, args.sequences)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
