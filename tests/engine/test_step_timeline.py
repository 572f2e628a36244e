"""The step timeline's phases and the device's idle fraction, from known timestamps."""

import pytest

from jaxengine.engine.step_timeline import StepTimeline


def test_phases_gaps_and_idle_fraction_of_a_synchronous_loop():
    t = StepTimeline()
    # step 1: starts 0.0, dispatch 0.002-0.003, waited for from 0.003, tokens at 0.013, ends 0.014
    t.record(0.0, 0.002, 0.003, 0.003, 0.013, 0.014)
    # step 2: starts 0.014, dispatch 0.016-0.017, tokens at 0.027, ends 0.028 (gap 0.016 - 0.013)
    t.record(0.014, 0.016, 0.017, 0.017, 0.027, 0.028)
    t.pause()  # out of work: the wait until the next request is no gap
    t.record(5.0, 5.001, 5.002, 5.002, 5.012, 5.013)
    stats = t.as_dict()
    assert stats["step_host_before_ms"] == pytest.approx(2.0)
    assert stats["step_dispatch_ms"] == pytest.approx(1.0)
    assert stats["step_device_wait_ms"] == pytest.approx(10.0)
    assert stats["step_host_after_ms"] == pytest.approx(1.0)
    assert stats["step_device_idle_gap_ms"] == pytest.approx(3.0)  # one gap: step 2's
    busy = 0.011 + 0.011 + 0.011
    assert stats["device_idle_fraction"] == pytest.approx(0.003 / (0.003 + busy))


def test_overlapped_steps_leave_no_gap_unless_one_was_seen_done_before_the_next_dispatch():
    t = StepTimeline()
    # step 1 dispatched 0.001-0.002; step 2 dispatched 0.004-0.005, before step 1's tokens were
    # read (waited for 0.005-0.010, ready 0.010): no gap; step 2 waited for 0.011-0.020.
    t.record(0.0, 0.001, 0.002, 0.005, 0.010, 0.011)
    t.record(0.003, 0.004, 0.005, 0.011, 0.020, 0.021)
    # step 3: the host saw step 2 done at 0.020 (its read) and dispatched step 3 at 0.023; step 3
    # was already done when the host looked at 0.026 (seen ready at 0.025, before the wait)
    t.record(0.021, 0.023, 0.024, 0.026, 0.025, 0.027)
    stats = t.as_dict()
    assert [s.idle_gap for s in t.recent] == [None, 0.0, pytest.approx(0.003)]
    assert [s.device_wait for s in t.recent] == [pytest.approx(0.005), pytest.approx(0.009), 0.0]
    assert t.recent[2].host_after == pytest.approx(0.001)
    busy = (0.010 - 0.001) + (0.020 - 0.010) + (0.025 - 0.023)
    assert stats["device_idle_fraction"] == pytest.approx(0.003 / (0.003 + busy))


def test_no_steps_reports_zeros():
    assert StepTimeline().as_dict()["device_idle_fraction"] == 0.0
