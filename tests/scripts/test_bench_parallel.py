"""bench_parallel.py's per-device shares on the 7B-shaped Nemotron-H config (shapes only), and its fit table."""

import glob

from tests.scripts.load_script import load_script

CONFIG = "configs/models/nemotron-h-7b-shape"


def test_device_shares_shrink_with_the_tensor_parallel_size():
    bench = load_script("bench_parallel")
    one, eight = (bench.measure(CONFIG, "bfloat16", tp, context_tokens=1024, sequences=4) for tp in (1, 8))
    # Everything but the norms and other small vectors splits: just over an eighth stays.
    assert 1 / 8 <= eight["weights_gib"] / one["weights_gib"] < 0.13
    assert eight["weights_total_gib"] == one["weights_total_gib"] == one["weights_gib"]
    # 32 KV heads and 64 Mamba heads split eight ways exactly.
    assert eight["kv_cache_gib"] * 8 == one["kv_cache_gib"] > 0
    assert eight["states_gib"] * 8 == one["states_gib"] > 0
    assert one["allreduce_bytes_per_token"] == 0 < eight["allreduce_bytes_per_token"]


# Published total parameter counts, in billions, of the real models the shape configs copy.
PUBLISHED_PARAMS_B = {
    "jamba-mini-1.5-shape": 52,
    "nemotron-h-56b-shape": 56,
    "qwen3-next-80b-a3b-thinking-shape": 80,
    "qwen3.5-122b-a10b-shape": 122,
}


def test_fit_table_at_tensor_parallel_8():
    bench = load_script("bench_parallel")
    rows = {
        r["model"]: r
        for r in (
            bench.fit(d, "bfloat16", context_tokens=1024, sequences=4)
            for d in sorted(glob.glob("configs/models/*-shape"))
        )
    }
    assert set(PUBLISHED_PARAMS_B) < set(rows)
    for model, params_b in PUBLISHED_PARAMS_B.items():
        assert abs(rows[model]["params_b"] / params_b - 1) < 0.05, model
    for model, r in rows.items():
        # bfloat16 weights split eight ways; only the norms and small vectors stay whole.
        assert 1 <= r["weights_gib"] * bench.GIB * 8 / (r["params_b"] * 1e9 * 2) < 1.03, model
    assert all(rows["nemotron-h-7b-shape"]["fits"].values())
    # 18.7 GiB of weights a device: over 90% of a v5e's 16 GiB, under 90% of a v6e's 32 GiB.
    assert rows["qwen3-next-80b-a3b-thinking-shape"]["fits"] == {"v5e-8": False, "v6e-8": True, "8x H200": True}
    # 2**24 tokens of KV: 4 attention layers x K and V x 4 of 32 heads x 128 x 2 bytes = 128 GiB a device.
    huge = bench.fit(CONFIG, "bfloat16", context_tokens=2**24, sequences=4)
    assert huge["cache_gib"] > 128 and not any(huge["fits"].values())
