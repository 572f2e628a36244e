"""bench_shapes.py's verdicts from step times given by hand: a shape buys nothing when the
shape its steps fall back to runs within the margin of its time."""

from jaxengine.engine.batch_builder import Shape
from tests.scripts.load_script import load_script

DECODE_1 = Shape(1, 1, decode=True)
DECODE_1_SAVE = Shape(1, 1, decode=True, num_saves=1)
MIXED_16 = Shape(16, 1, decode=False, num_saves=2)
MIXED_32 = Shape(32, 1, decode=False, num_saves=3)


def test_a_shape_buys_nothing_when_its_fallback_costs_the_same():
    bench = load_script("bench_shapes")
    costs = {DECODE_1: 1.00, DECODE_1_SAVE: 1.04, MIXED_16: 2.0, MIXED_32: 4.0}
    rows = {r["shape"]: r for r in bench.report(costs, {DECODE_1.key: 3.0}, margin=0.05)}
    decode = rows["decode T=1 S=1 saves=0"]
    assert decode["fallback"] == "T=1 S=1 saves=1" and decode["buys_nothing"]
    assert decode["compile_s"] == 3.0
    assert abs(decode["fallback_ratio"] - 1.04) < 1e-9
    # Its fallback falls back to a mixed step twice its time; the largest shape has none.
    assert rows["decode T=1 S=1 saves=1"]["fallback"] == "T=16 S=1 saves=2"
    assert not rows["decode T=1 S=1 saves=1"]["buys_nothing"]
    assert not rows["mixed T=16 S=1 saves=2"]["buys_nothing"]
    assert rows["mixed T=32 S=1 saves=3"]["fallback"] is None
    assert not rows["mixed T=32 S=1 saves=3"]["buys_nothing"]


def test_the_fallback_is_the_cheapest_shape_that_covers_it():
    bench = load_script("bench_shapes")
    shapes = [DECODE_1, DECODE_1_SAVE, MIXED_16, MIXED_32]
    assert bench.fallback(DECODE_1, shapes) == DECODE_1_SAVE
    assert bench.fallback(MIXED_16, shapes) == MIXED_32
    assert bench.fallback(MIXED_32, shapes) is None
