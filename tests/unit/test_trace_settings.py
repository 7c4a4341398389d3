"""Tracing's pure parts: Triton's --trace-config syntax, settings updates, sampling, the trace file writer."""

from __future__ import annotations

import json

import pytest

from server.errors import DisabledError, InvalidInputError
from server.observability.tracing import settings as ts
from server.observability.tracing.control import TraceControl
from server.observability.tracing.file_writer import TraceFileWriter


def test_flags_in_tritons_syntax():
    s = ts.from_flags(["triton,file=/tmp/t.json", "triton,log-frequency=50", "rate=100", "level=TIMESTAMPS",
                       "level=TENSORS", "count=10", "mode=opentelemetry", "opentelemetry,url=http://c:4318/v1/traces",
                       "opentelemetry,resource=service.name=edge", "opentelemetry,bsp_schedule_delay=20"])
    assert (s.file, s.log_frequency, s.rate, s.count, s.mode) == ("/tmp/t.json", 50, 100, 10, "opentelemetry")
    assert s.level == ("TIMESTAMPS", "TENSORS")
    assert s.otel.url == "http://c:4318/v1/traces" and s.otel.resource == (("service.name", "edge"),)
    assert s.otel.schedule_delay_ms == 20
    assert ts.from_flags(["level=TIMESTAMPS", "level=OFF"]).level == ()
    assert ts.from_flags([]) == ts.TraceSettings()  # Triton's defaults: OFF, rate 1000, count -1


@pytest.mark.parametrize("flag, words", [
    ("rate=fast", "rate"), ("count=-2", "count"), ("level=LOUD", "OFF, TIMESTAMPS or TENSORS"),
    ("mode=zipkin", "triton or opentelemetry"), ("file=/tmp/x", "unknown setting"), ("triton,rate", "SETTING=VALUE"),
    ("opentelemetry,resource=novalue", "KEY=VALUE"), ("opentelemetry,colour=red", "unknown OpenTelemetry setting"),
])
def test_bad_flags_say_what_is_wrong(flag, words):
    with pytest.raises(ValueError, match=words):
        ts.from_flags([flag])


def control(**settings) -> TraceControl:
    return TraceControl(ts.TraceSettings(**{"level": ("TIMESTAMPS",), "file": "/dev/null", "rate": 1, **settings}),
                        allow_updates=True)


def test_model_settings_keep_their_own_keys_and_follow_the_global_ones():
    tracing = control()
    assert tracing.update({"trace_rate": ["3"]}, "m")["trace_rate"] == "3"
    assert tracing.update({"trace_level": ["TIMESTAMPS", "TENSORS"]})["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    model = tracing.values("m")
    assert model["trace_rate"] == "3" and model["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    assert tracing.update({"trace_rate": None}, "m")["trace_rate"] == "1"
    tracing.update({"trace_rate": "9"})
    assert tracing.update({"trace_rate": None})["trace_rate"] == "1"  # global null: the start value


@pytest.mark.parametrize("changes, words", [
    ({"trace_file": ["/etc/passwd"]}, "can not be updated through network protocol"),
    ({"trace_mode": ["opentelemetry"]}, "set when the server starts"),
    ({"trace_rate": ["1", "2"]}, "takes one value"), ({"trace_count": ["-5"]}, "-1 or more"),
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, "cannot be combined"), ({"trace_colour": ["red"]}, "unknown trace setting"),
])
def test_bad_updates_change_nothing(changes, words):
    tracing = control()
    before = tracing.values()
    with pytest.raises(InvalidInputError, match=words):
        tracing.update({"trace_rate": ["7"], **changes})
    assert tracing.values() == before


def test_updates_need_the_flag_reading_does_not():
    tracing = TraceControl(ts.TraceSettings(), allow_updates=False)
    assert tracing.values()["trace_level"] == ["OFF"]
    with pytest.raises(DisabledError, match="--allow-trace-settings"):
        tracing.update({"trace_rate": ["1"]})


def test_rate_and_count_decide_which_requests_are_traced():
    tracing = control(rate=3, count=2)
    taken = [tracing.begin("m", f"r{i}", 0) is not None for i in range(12)]
    assert taken == [False, False, True, False, False, True] + [False] * 6
    assert tracing.values()["trace_count"] == "0"
    off = control(level=())
    assert not off.active and off.begin("m", "r", 0) is None


def test_file_stays_a_json_array_after_every_write(tmp_path):
    path = str(tmp_path / "t.json")
    writer = TraceFileWriter()
    for i in range(3):
        writer.add(path, [{"id": i, "model_name": "m"}], 0, False)
        assert writer.sync()
        assert [e["id"] for e in json.loads(open(path).read())] == list(range(i + 1))
    writer.close()
    assert [e["id"] for e in json.loads(open(path).read())] == [0, 1, 2]


def test_log_frequency_and_roll_write_indexed_files(tmp_path):
    path = str(tmp_path / "t.json")
    writer = TraceFileWriter()
    for i in range(5):
        writer.add(path, [{"id": i}], 2, False)
    writer.add(path, [{"id": 9}], 0, True)  # taken under a count: waits for its roll
    writer.roll(path)
    writer.close()
    files = {p.name: [e["id"] for e in json.loads(p.read_text())] for p in tmp_path.iterdir()}
    assert files == {"t.json.0": [0, 1], "t.json.1": [2, 3], "t.json.2": [4, 9]}
