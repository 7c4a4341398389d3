"""Tracing with `--frontend-processes 2`: ModelInfer decoded by a front-end process is traced as in one process.

The engine samples and writes; the front ends' timestamps come over the arena link (tracing/hop.py).
One server writes a trace file while calls arrive on many connections (the kernel spreads them over
both front ends), tracing is turned off and on again through tritonclient (the front ends are told),
and a count shards the file as Triton does. A second server, started with tracing off, exports
OpenTelemetry spans once it is turned on: a client's traceparent crosses the process hop and parents
the span.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer, link_shipped_models, wait_for
from tests.integration.test_tracing import GRPC_ORDER, assert_ordered, named, read_traces, simple_inputs
from tests.integration.test_tracing_otel import TRACE_ID, Collector, attributes, children, request_span

httpclient = pytest.importorskip("tritonclient.http")

FRONTENDS = ("--frontend-processes", "2")
CONNECTIONS = 8
PARENT = "5fb397be34d26b51"


def infer_on_new_connection(server, request_id: str, metadata=()) -> dict:
    """One ModelInfer on a connection of its own: each new connection may land on either front end."""
    with grpc.insecure_channel(server.address) as channel:
        response = kserve.stub(channel).ModelInfer(kserve.request("simple", simple_inputs(), request_id=request_id),
                                                   timeout=60, metadata=metadata)
    return kserve.outputs(response)


@pytest.fixture(scope="module")
def file_run(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple")
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    server = RunningServer(repo, *FRONTENDS, "--trace-config", f"triton,file={path}", "--trace-config",
                           "level=TIMESTAMPS", "--trace-config", "rate=1", "--allow-trace-settings")
    seen = {}
    try:
        seen["answers"] = [infer_on_new_connection(server, f"fe-{i}") for i in range(CONNECTIONS)]
        client = httpclient.InferenceServerClient(server.http_address)
        client.update_trace_settings(settings={"trace_level": ["OFF"]})
        infer_on_new_connection(server, "fe-off")
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_count": "2"})
        for i in range(3):  # two traces left: count-0 and count-1, written to trace.json.0
            infer_on_new_connection(server, f"count-{i}")
    finally:
        assert server.stop() == 0
    seen["traces"] = read_traces(path)
    seen["indexed"] = read_traces(Path(f"{path}.0"))
    seen["files"] = sorted(p.name for p in path.parent.iterdir())
    return seen


def test_calls_served_by_front_ends_are_traced_as_in_one_process(file_run):
    expected = simple_inputs()["INPUT0"] + simple_inputs()["INPUT1"]
    assert all(np.array_equal(a["OUTPUT0"], expected) for a in file_run["answers"])
    for i in range(CONNECTIONS):
        [trace] = named(file_run["traces"], f"fe-{i}")
        assert trace["header"]["model_name"] == "simple" and trace["header"]["model_version"] == 1
        assert_ordered(trace, GRPC_ORDER)  # the front end's read and send around the engine's timestamps
        names = [n for n, _ in trace["stamps"]]
        assert names.count("GRPC_SEND_START") == names.count("GRPC_SEND_END") == 1
    ids = [t["header"]["id"] for t in file_run["traces"].values()]
    assert len(ids) == len(set(ids))  # one writer: ids unique across both front ends


def test_turning_tracing_off_and_a_count_reach_the_front_ends_calls(file_run):
    assert not named(file_run["traces"], "fe-off") and not named(file_run["indexed"], "fe-off")
    assert sorted(t["header"]["request_id"] for t in file_run["indexed"].values()) == ["count-0", "count-1"]
    for trace in file_run["indexed"].values():
        assert_ordered(trace, GRPC_ORDER)
    assert not named(file_run["traces"], "count-2") and not named(file_run["indexed"], "count-2")
    assert file_run["files"] == ["trace.json", "trace.json.0"]


@pytest.fixture(scope="module")
def otel(tmp_path_factory):
    """Started with tracing off, so a front end learns that it is on only from a TRACING frame."""
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple")
    collector = Collector()
    server = RunningServer(repo, *FRONTENDS, "--trace-config", "mode=opentelemetry", "--trace-config",
                           f"opentelemetry,url={collector.url}", "--trace-config", "opentelemetry,bsp_schedule_delay=50",
                           "--trace-config", "level=OFF", "--trace-config", "rate=1", "--allow-trace-settings")
    server.collector = collector
    yield server
    server.stop()
    collector.stop()


def test_a_clients_traceparent_crosses_the_process_hop(otel):
    collector, probes = otel.collector, itertools.count()
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT}-01"),)
    infer_on_new_connection(otel, "fe-otel-off", metadata)  # off: forwarded or not, nothing is traced
    httpclient.InferenceServerClient(otel.http_address).update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})

    def parented() -> bool:
        """One call on a new connection (either front end); its span is the client's child once the front
        end that served it has been told tracing is on (the frame is on its way when the update returns)."""
        request_id = f"fe-otel-{next(probes)}"
        infer_on_new_connection(otel, request_id, metadata)
        wait_for(lambda: request_span(collector, request_id) is not None, what=f"the span of {request_id}")
        return request_span(collector, request_id).parent_span_id.hex() == PARENT

    for _ in range(CONNECTIONS):
        wait_for(parented, what="a front end to forward the client's traceparent")
    assert request_span(collector, "fe-otel-off") is None
    span = request_span(collector, f"fe-otel-{next(probes) - 1}")
    assert span.trace_id.hex() == TRACE_ID and attributes(span.attributes)["model_name"] == "simple"
    assert {"GRPC_WAITREAD_START", "QUEUE_START", "GRPC_SEND_START", "GRPC_SEND_END"} <= {e.name for e in span.events}
    assert len(span.links) == 1
    wait_for(lambda: {"queue", "compute", "send"} <= set(children(collector, span)), what="the child spans")
