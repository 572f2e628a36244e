"""Time per token of the gated-delta-rule scan beside the Mamba2 SSD scan, at equal state size.

Both are the pure-jnp references as the engine calls them on CPU (`kernels.py`: rows of
`REFERENCE_SCAN_ROW` tokens), jitted, each with the states its checkpoints would save at
every 16th position. The state per head and sequence is the same size: SSD heads of
P x N = 64 x 64, gated-delta value heads of d_k x d_v = 64 x 64, 16 heads each (the
bench_throughput models' Mamba2 layer). Gated DeltaNet's value heads read 8 key heads (Qwen3.5's
ratio of 2). Cases: one prefill of 512 tokens, 16 sequences of 32 tokens (chunked prefill of
a batch), and the one-token update of 16 sequences (decode).

Usage: python scripts/bench_recurrent_scans.py [--trials 20]
"""

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxengine.models.kernels import reference_gated_delta, reference_scan
from pallas_kernels.gated_delta import gated_delta_states_at, gated_delta_update
from pallas_kernels.ssd import ssd_state_update, ssd_states_at

sys.path.insert(0, str(Path(__file__).parent))
from profile_context_scaling import best_of  # noqa: E402

HEADS, DIM, STATE = 16, 64, 64  # SSD: H x P x N; gated delta: H_v x d_k x d_v
KEY_HEADS = 8
CHUNK = 64
SAVE_EVERY = 16


def batch(num_seqs: int, length: int):
    """cu_seqlens, start_pos and the checkpoint requests (every SAVE_EVERY positions)."""
    cu = jnp.asarray(np.arange(num_seqs + 1) * length, jnp.int32)
    start = jnp.zeros(num_seqs, jnp.int32)
    saves = [(s, p) for s in range(num_seqs) for p in range(SAVE_EVERY, length + 1, SAVE_EVERY)]
    seq, pos = (jnp.asarray(v, jnp.int32) for v in zip(*saves))
    return cu, start, seq, pos


@functools.partial(jax.jit, static_argnames="window")
def ssd_step(x, dt, A, B, C, init, cu, start, seq, pos, *, window):
    scan = reference_scan(x, dt, A, B, C, init, cu, start, chunk_size=CHUNK)
    return scan.y, ssd_states_at(x, dt, A, B, init, cu, start, scan, seq, pos, window=window)


@functools.partial(jax.jit, static_argnames="window")
def gated_delta_step(q, k, v, g, beta, init, cu, start, seq, pos, *, window):
    scan = reference_gated_delta(q, k, v, g, beta, init, cu, start, chunk_size=CHUNK, scale=DIM**-0.5)
    return scan.o, gated_delta_states_at(k, v, g, beta, init, cu, start, scan, seq, pos, window=window)


def scan_times(num_seqs: int, length: int, trials: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    tokens = num_seqs * length
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    cu, start, seq, pos = batch(num_seqs, length)
    window = 16  # the reference rows' length
    ssd = best_of(
        functools.partial(ssd_step, window=window),
        f32(tokens, HEADS, DIM),
        jnp.full((tokens, HEADS), 0.05),
        -jnp.ones(HEADS),
        f32(tokens, 1, STATE),
        f32(tokens, 1, STATE),
        f32(num_seqs, HEADS, DIM, STATE),
        cu,
        start,
        seq,
        pos,
        trials=trials,
    )
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    gdn = best_of(
        functools.partial(gated_delta_step, window=window),
        unit(f32(tokens, KEY_HEADS, DIM)),
        unit(f32(tokens, KEY_HEADS, DIM)),
        f32(tokens, HEADS, STATE),
        jnp.full((tokens, HEADS), -0.05),
        jnp.full((tokens, HEADS), 0.5),
        f32(num_seqs, HEADS, DIM, STATE),
        cu,
        start,
        seq,
        pos,
        trials=trials,
    )
    return ssd / tokens, gdn / tokens


def update_times(num_seqs: int, trials: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    ssd = best_of(
        jax.jit(ssd_state_update),
        f32(num_seqs, HEADS, DIM, STATE),
        f32(num_seqs, HEADS, DIM),
        jnp.full((num_seqs, HEADS), 0.05),
        -jnp.ones(HEADS),
        f32(num_seqs, 1, STATE),
        f32(num_seqs, 1, STATE),
        trials=trials,
    )
    gdn = best_of(
        jax.jit(functools.partial(gated_delta_update, scale=DIM**-0.5)),
        f32(num_seqs, HEADS, DIM, STATE),
        f32(num_seqs, KEY_HEADS, DIM),
        f32(num_seqs, KEY_HEADS, DIM),
        f32(num_seqs, HEADS, STATE),
        jnp.full((num_seqs, HEADS), -0.05),
        jnp.full((num_seqs, HEADS), 0.5),
        trials=trials,
    )
    return ssd / num_seqs, gdn / num_seqs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    print(f"{jax.devices()[0].device_kind}; state per head {DIM} x {STATE}, {HEADS} heads; best of {args.trials}")
    print("| case | SSD scan, us/token | gated delta, us/token | gated delta / SSD |")
    print("| --- | ---: | ---: | ---: |")
    rows = [
        ("1 x 512 tokens (prefill)", scan_times(1, 512, args.trials)),
        ("16 x 32 tokens (batched prefill)", scan_times(16, 32, args.trials)),
        ("16 x 1 token (decode update)", update_times(16, args.trials)),
    ]
    for name, (ssd, gdn) in rows:
        print(f"| {name} | {ssd * 1e6:.2f} | {gdn * 1e6:.2f} | {gdn / ssd:.2f} |")


if __name__ == "__main__":
    main()
