"""bench_load_memory.py's one load: the model's bytes, and device 0's share of them."""

from safetensors.numpy import load_file

from jaxengine.run_config import DEFAULT_MODEL
from tests.scripts.load_script import load_script


def test_one_load_at_tp_2_leaves_device_0_half_of_the_model():
    bench = load_script("bench_load_memory")
    row = bench.child(str(DEFAULT_MODEL), 2, "float32")
    stored = load_file(DEFAULT_MODEL / "model.safetensors")
    text_model = sum(x.nbytes for name, x in stored.items() if not name.startswith("mtp."))
    assert row["model_bytes"] == text_model  # float32 as stored, the MTP module not loaded
    # Everything but the norms splits in two.
    assert row["model_bytes"] / 2 <= row["device0_bytes"] < 0.52 * row["model_bytes"]
    assert row["seconds"] > 0 and row["device0_peak_bytes"] is None  # CPU devices keep no statistics
