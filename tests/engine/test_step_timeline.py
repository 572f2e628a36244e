"""The step timeline's phases and the device's idle fraction, from known timestamps."""

import pytest

from jaxengine.engine.step_timeline import StepTimeline


def test_phases_gaps_and_idle_fraction():
    t = StepTimeline()
    # step 1: starts 0.0, dispatch 0.002-0.003, tokens at 0.013, ends 0.014
    t.record(0.0, 0.002, 0.003, 0.013, 0.014)
    # step 2: starts 0.014, dispatch 0.016-0.017, tokens at 0.027, ends 0.028 (gap 0.016 - 0.013)
    t.record(0.014, 0.016, 0.017, 0.027, 0.028)
    t.pause()  # out of work: the wait until the next request is no gap
    t.record(5.0, 5.001, 5.002, 5.012, 5.013)
    stats = t.as_dict()
    assert stats["step_host_before_ms"] == pytest.approx(2.0)
    assert stats["step_dispatch_ms"] == pytest.approx(1.0)
    assert stats["step_device_wait_ms"] == pytest.approx(10.0)
    assert stats["step_host_after_ms"] == pytest.approx(1.0)
    assert stats["step_device_idle_gap_ms"] == pytest.approx(3.0)  # one gap: step 2's
    busy = 0.011 + 0.011 + 0.011
    assert stats["device_idle_fraction"] == pytest.approx(0.003 / (0.003 + busy))


def test_no_steps_reports_zeros():
    assert StepTimeline().as_dict()["device_idle_fraction"] == 0.0
