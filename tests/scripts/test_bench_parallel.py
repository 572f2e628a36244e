"""bench_parallel.py's per-device shares on the 7B-shaped Nemotron-H config (shapes only)."""

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
