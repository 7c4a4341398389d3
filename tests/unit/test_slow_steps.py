"""A generation step far slower than predicted is reported once per interval, saying whether it computed or
waited; ordinary steps, and slow ones the cost model expected, are not."""

import logging

from server.runners import slow_steps
from server.runners.slow_steps import SlowSteps, StepTiming

MS = 1_000_000


def test_a_stalled_step_is_reported_with_where_its_time_went(caplog):
    slow = SlowSteps("m")
    with caplog.at_level(logging.WARNING, logger="server.runners.slow_steps"):
        assert not slow.check(100 * MS, 20.0, StepTiming(95 * MS, 0.09), 40, 40)  # short: not a stall
        assert not slow.check(300 * MS, 100.0, StepTiming(295 * MS, 0.29), 1024, 8)  # as long as predicted
        assert slow.check(600 * MS, 40.0, StepTiming(590 * MS, 0.02, 0.01, 3, 40), 48, 48)
    (record,) = caplog.records
    text = record.getMessage()
    assert "took 600 ms, predicted 40 ms (48 tokens, 48 sequences)" in text
    assert "590 ms in the step thread, 30 ms of it on a CPU (20 user, 10 system; mostly waiting" in text
    assert "3 page faults, 40 times preempted; 10 ms on the event loop" in text


def test_a_step_that_computed_says_so_and_reports_are_spaced(caplog):
    slow = SlowSteps("m", interval_s=3600)
    with caplog.at_level(logging.WARNING, logger="server.runners.slow_steps"):
        assert slow.check(800 * MS, 0.0, StepTiming(800 * MS, 0.78), 1024, 2)  # no prediction yet: 250 ms alone
        assert slow.check(900 * MS, 0.0, StepTiming(900 * MS, 0.01), 1024, 2)  # counted, not logged again
    assert len(caplog.records) == 1 and "; computing)" in caplog.records[0].getMessage()
    assert slow.unreported == 1
    slow.interval_s, slow._next_report = 0.0, 0.0  # the interval is over
    with caplog.at_level(logging.WARNING, logger="server.runners.slow_steps"):
        assert slow.check(700 * MS, 0.0, StepTiming(700 * MS, 0.65), 16, 16)
    assert "1 more slow steps since the last report" in caplog.records[-1].getMessage() and slow.unreported == 0


def test_timed_measures_the_thread_that_runs_the_step():
    def spin(n):
        total = 0
        for i in range(n):
            total += i
        return total

    result, timing = slow_steps.timed(spin, 200_000)
    assert result == sum(range(200_000))
    assert 0 < timing.cpu_ms <= timing.wall_ns / MS + 10  # CPU of this thread only, never far above its wall time
