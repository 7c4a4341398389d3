"""The summary line for undecodable bodies: one line per interval however many bodies, each counted."""

import logging

from server.doors.grpc.passthrough import MalformedBodies


def test_a_flood_of_bad_bodies_logs_one_line_per_interval_with_the_count(caplog):
    now = [1000.0]
    bodies = MalformedBodies(interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="server.doors.grpc.passthrough"):
        for _ in range(50):
            bodies.record("ModelInfer", "truncated message")
        now[0] += 59.0
        bodies.record("ModelInfer", "still inside the interval")
        now[0] += 2.0
        bodies.record("ModelStreamInfer", "the interval is over")
    lines = [r.getMessage() for r in caplog.records if "undecodable request bod" in r.getMessage()]
    assert lines == [
        "1 undecodable request body answered INVALID_ARGUMENT (latest: ModelInfer: truncated message)",
        "51 undecodable request bodies answered INVALID_ARGUMENT (latest: ModelStreamInfer: the interval is over)",
    ]
    assert bodies.counts == {"ModelInfer": 51, "ModelStreamInfer": 1}
