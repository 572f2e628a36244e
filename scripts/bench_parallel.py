"""Per-device bytes and all-reduce volume under tensor parallelism, from the shardings alone.

    python scripts/bench_parallel.py [--model-config configs/models/nemotron-h-7b-shape] \
        [--dtype bfloat16] [--tp 1 2 4 8] [--context-tokens 131072] [--sequences 64] [--json OUT.json]

No weights and no accelerator: the model's abstract parameters (shapes only) on eight fake
CPU devices, each placed by the engine's own rules (`jaxengine/engine/mesh.py`). For each
tensor-parallel size it prints device 0's share of the weights, of the KV cache for
`--context-tokens` tokens and of the live recurrent states of `--sequences` sequences, and the
all-reduce payload per token: every projection whose input dimension is split (attention's
o_proj, the MLPs' down_proj, the recurrent mixers' out_proj, ...) ends in an all-reduce of one
hidden-size vector per token; the vocabulary-split embedding adds one more.
"""

import argparse
import json
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jaxengine.engine.mesh import MODEL, Parallelism, axis_rules, kv_page_sharding, param_shardings, state_sharding  # noqa: E402
from jaxengine.models.config import load_model_config  # noqa: E402
from jaxengine.models.loader import abstract_model  # noqa: E402
from jaxengine.models.mixers import recurrent_states  # noqa: E402

GIB = 2**30


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
    total = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves)
    # Row-parallel projections: a 2-D kernel (or an expert stack's down projection) split on its input.
    row_parallel = sum(1 for x, s in zip(leaves, shardings)
                       if x.ndim >= 2 and s.spec and s.spec[x.ndim - 2] == MODEL and x.shape[-1] == cfg.hidden_size)
    kv = 0
    if cfg.num_kv_layers:
        a = cfg.attention
        page = (1, 1, a.num_kv_heads, a.head_dim)
        kv = 2 * cfg.num_kv_layers * context_tokens * _shard_bytes(kv_page_sharding(mesh, rules, page), page, dtype)
    states = sum(_shard_bytes(state_sharding(mesh, rules, arr, sequences), (sequences, *arr.shape), arr.dtype(dtype))
                 for arrays in recurrent_states(cfg) for arr in arrays)
    itemsize = jnp.dtype(dtype).itemsize
    return dict(tp=tp, weights_gib=weights / GIB, weights_total_gib=total / GIB, kv_cache_gib=kv / GIB,
                states_gib=states / GIB, row_parallel_projections=row_parallel,
                allreduce_bytes_per_token=(row_parallel + 1) * cfg.hidden_size * itemsize if tp > 1 else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-config", default="configs/models/nemotron-h-7b-shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context-tokens", type=int, default=131072)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(args.model_config, args.dtype, tp, args.context_tokens, args.sequences) for tp in args.tp]
    print(f"{args.model_config}, {args.dtype}; device 0's share; KV for {args.context_tokens} tokens, states of "
          f"{args.sequences} sequences")
    print("| TP | weights GiB | KV cache GiB | live states GiB | all-reduce bytes / token |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['tp']} | {r['weights_gib']:.2f} | {r['kv_cache_gib']:.2f} | {r['states_gib']:.3f} | "
              f"{r['allreduce_bytes_per_token']:,} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
