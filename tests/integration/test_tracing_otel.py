"""OpenTelemetry mode: spans a real server exports over OTLP/HTTP, received by a collector in this test.

The collector is a small HTTP endpoint that decodes each ExportTraceServiceRequest with
opentelemetry-proto. Checked: a client's W3C traceparent (HTTP header, gRPC metadata) parents the
request's span; the request span has queue / compute / send children and links to its batch's span;
requests that rode one batch link to the same batch span; a generation span carries the GenAI
attributes, an OpenAI completion's too (under the client's traceparent header); each request on a
ModelStreamInfer stream is a span under the stream's traceparent; a Python model's BLS call is a child
span of its caller's request span; once the collector is gone, requests still succeed and the lost
spans are counted.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from tests import builders, kserve
from tests.conftest import RunningServer, link_shipped_models, wait_for

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
httpclient = pytest.importorskip("tritonclient.http")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
HTTP_PARENT, GRPC_PARENT = "00f067aa0ba902b7", "a3ce929d0e0e4736"
OPENAI_PARENT, STREAM_PARENT = "b7ad6b7169203331", "0af7651916cd43dd"
BLS_CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X")
            called = pb_utils.InferenceRequest(model_name="gated", inputs=[x], requested_output_names=["Y"]).exec()
            responses.append(pb_utils.InferenceResponse([pb_utils.get_output_tensor_by_name(called, "Y")]))
        return responses
"""


class Collector:
    """An OTLP/HTTP traces endpoint: every span it is sent, decoded, with its resource attributes."""

    def __init__(self):
        self.spans: list = []
        self.resources: list[dict] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service.ExportTraceServiceRequest.FromString(body)
                with collector._lock:
                    for resource_spans in request.resource_spans:
                        collector.resources.append(attributes(resource_spans.resource.attributes))
                        for scope in resource_spans.scope_spans:
                            collector.spans.extend(scope.spans)
                reply = trace_service.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                """Silent: the collector's access log is not the test's output."""

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def find(self, predicate) -> list:
        with self._lock:
            return [s for s in self.spans if predicate(s)]


def attributes(kvs) -> dict:
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        value = getattr(kv.value, which)
        out[kv.key] = list(v.string_value for v in value.values) if which == "array_value" else value
    return out


def request_span(collector: Collector, request_id: str):
    found = collector.find(lambda s: s.name.startswith(("infer ", "text_completion "))
                           and attributes(s.attributes).get("request_id") == request_id)
    return found[0] if found else None


def children(collector: Collector, span) -> dict:
    return {s.name: s for s in collector.find(lambda s: s.parent_span_id == span.span_id)}


@pytest.fixture(scope="module")
def otel(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    gate = repo / "gate"
    builders.gated_model(repo, "gated", "dynamic_batching: {}\n", gate=gate)
    link_shipped_models(repo, "tiny_llama")
    (repo / "bls_caller" / "1").mkdir(parents=True)
    (repo / "bls_caller" / "1" / "model.py").write_text(BLS_CALLER)
    (repo / "bls_caller" / "config.yaml").write_text("backend: python\nmax_batch_size: 0\n"
                                                     "input: [{name: X, data_type: TYPE_FP32, dims: [1, 2]}]\n"
                                                     "output: [{name: Y, data_type: TYPE_FP32, dims: [1, 2]}]\n")
    collector = Collector()
    server = RunningServer(repo, "--trace-config", "mode=opentelemetry", "--trace-config", f"opentelemetry,url={collector.url}",
                           "--trace-config", "opentelemetry,resource=deployment.environment=test",
                           "--trace-config", "opentelemetry,bsp_schedule_delay=50",
                           "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1")
    server.gate, server.collector = gate, collector
    yield server
    server.stop()
    collector.stop()


def gated_infer(server, request_id: str, value: float = 1.0, metadata=()):
    inputs = {"X": np.full((1, 2), value, np.float32)}
    return kserve.stub(server.channel).ModelInfer(kserve.request("gated", inputs, request_id=request_id), timeout=60,
                                                  metadata=metadata)


def test_http_request_span_is_the_child_of_the_clients_traceparent(otel):
    client = httpclient.InferenceServerClient(otel.http_address)
    tensor = httpclient.InferInput("X", [1, 2], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 2), np.float32))
    client.infer("gated", [tensor], request_id="otel-http", headers={"traceparent": f"00-{TRACE_ID}-{HTTP_PARENT}-01"})
    collector = otel.collector
    wait_for(lambda: request_span(collector, "otel-http") is not None, what="the HTTP request's span")
    span = request_span(collector, "otel-http")
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == HTTP_PARENT
    assert attributes(span.attributes)["model_name"] == "gated"
    wait_for(lambda: {"receive", "queue", "compute", "send"} <= set(children(collector, span)), what="child spans")
    kids = children(collector, span)
    assert kids["queue"].end_time_unix_nano <= kids["compute"].start_time_unix_nano + 1
    assert {"batch assembly", "execute", "output"} <= set(children(collector, kids["compute"]))
    assert {e.name for e in span.events} >= {"HTTP_RECV_START", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
                                             "REQUEST_END", "HTTP_SEND_END"}
    [link] = span.links
    batch = collector.find(lambda s: s.span_id == link.span_id)
    assert batch and batch[0].name == "batch gated" and attributes(batch[0].attributes)["ferry.batch.size"] == 1
    assert {"service.name": "ferry", "deployment.environment": "test"}.items() <= collector.resources[0].items()


def test_grpc_metadata_traceparent_parents_the_span(otel):
    gated_infer(otel, "otel-grpc", metadata=(("traceparent", f"00-{TRACE_ID}-{GRPC_PARENT}-01"),))
    wait_for(lambda: request_span(otel.collector, "otel-grpc") is not None, what="the gRPC request's span")
    span = request_span(otel.collector, "otel-grpc")
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == GRPC_PARENT
    assert "GRPC_SEND_END" in {e.name for e in span.events}


def test_requests_that_rode_one_batch_link_to_one_batch_span(otel):
    """The gate holds the model's one instance on a first request, so the next three queue and run together."""
    running = otel.gate.with_name(otel.gate.name + ".running")
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(gated_infer, otel, "held", -1.0)
        wait_for(running.exists, what="the first request to hold the instance")
        rest = [pool.submit(gated_infer, otel, f"rode-{i}") for i in range(3)]
        otel.wait_for_metric("nv_inference_pending_request_count", 3, timeout_s=60, model="gated")
        otel.gate.touch()
        first.result(timeout=60)
        [f.result(timeout=60) for f in rest]
    collector = otel.collector
    wait_for(lambda: all(request_span(collector, f"rode-{i}") for i in range(3)), what="the three spans")
    links = {request_span(collector, f"rode-{i}").links[0].span_id for i in range(3)}
    assert len(links) == 1
    [batch] = collector.find(lambda s: s.span_id in links)
    assert attributes(batch.attributes)["ferry.batch.size"] == 3
    assert attributes(batch.attributes)["ferry.batch.requests"] == 3
    assert request_span(collector, "held").links[0].span_id not in links


def test_generation_span_carries_genai_attributes(otel):
    request = gen.GenerateRequest(model_name="tiny_llama", id="otel-gen", text="A ferry",
                                  sampling=gen.SamplingParams(max_tokens=5, ignore_eos=True))
    responses = list(gen_grpc.GenerationStub(otel.channel).Generate(request, timeout=120))
    wait_for(lambda: request_span(otel.collector, "otel-gen") is not None, what="the generation span")
    span = request_span(otel.collector, "otel-gen")
    found = attributes(span.attributes)
    assert span.name == "text_completion tiny_llama"
    assert found["gen_ai.request.model"] == "tiny_llama" and found["gen_ai.request.max_tokens"] == 5
    assert found["gen_ai.usage.output_tokens"] == sum(len(r.token_ids) for r in responses) == 5
    assert found["gen_ai.usage.input_tokens"] == responses[-1].usage.prompt_tokens > 0
    assert found["gen_ai.latency.time_to_first_token"] >= 0 and found["gen_ai.latency.time_in_queue"] >= 0
    assert found["gen_ai.response.finish_reasons"] == ["length"]


def test_openai_completion_span_has_genai_attributes_under_the_clients_traceparent(otel):
    openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")
    client = openai.OpenAI(base_url=otel.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    completion = client.completions.create(model="tiny_llama", prompt="A ferry", max_tokens=4,
                                           extra_body={"ignore_eos": True},
                                           extra_headers={"traceparent": f"00-{TRACE_ID}-{OPENAI_PARENT}-01"})
    wait_for(lambda: request_span(otel.collector, completion.id) is not None, what="the OpenAI request's span")
    span = request_span(otel.collector, completion.id)
    assert span.name == "text_completion tiny_llama"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == OPENAI_PARENT
    found = attributes(span.attributes)
    assert found["gen_ai.request.model"] == "tiny_llama" and found["gen_ai.operation.name"] == "text_completion"
    assert found["gen_ai.usage.input_tokens"] == completion.usage.prompt_tokens > 0
    assert found["gen_ai.usage.output_tokens"] == completion.usage.completion_tokens == 4
    assert found["gen_ai.latency.time_to_first_token"] >= 0 and found["gen_ai.latency.time_in_queue"] >= 0
    assert {"HTTP_RECV_START", "FIRST_TOKEN", "REQUEST_END", "HTTP_SEND_END"} <= {e.name for e in span.events}
    wait_for(lambda: {"receive", "send"} <= set(children(otel.collector, span)), what="receive and send spans")


def test_each_request_on_a_stream_is_a_span_under_the_streams_traceparent(otel):
    requests = [kserve.request("gated", {"X": np.full((1, 2), 2.0, np.float32)}, request_id=f"otel-stream-{i}")
                for i in range(2)]
    metadata = (("traceparent", f"00-{TRACE_ID}-{STREAM_PARENT}-01"),)
    responses = list(kserve.stub(otel.channel).ModelStreamInfer(iter(requests), timeout=60, metadata=metadata))
    assert [r.infer_response.id for r in responses] == ["otel-stream-0", "otel-stream-1"]
    collector = otel.collector
    wait_for(lambda: all(request_span(collector, f"otel-stream-{i}") for i in range(2)), what="the stream's spans")
    for i in range(2):
        span = request_span(collector, f"otel-stream-{i}")
        assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == STREAM_PARENT
        assert {"GRPC_WAITREAD_START", "QUEUE_START", "COMPUTE_START", "GRPC_SEND_END"} <= {e.name for e in span.events}
        assert len(span.links) == 1  # the batch it rode in


def test_a_bls_call_is_a_child_span_of_its_callers_request_span(otel):
    inputs = {"X": np.full((1, 2), 3.0, np.float32)}
    answer = kserve.stub(otel.channel).ModelInfer(kserve.request("bls_caller", inputs, request_id="otel-bls"), timeout=60,
                                                  metadata=(("traceparent", f"00-{TRACE_ID}-{GRPC_PARENT}-01"),))
    assert kserve.outputs(answer)["Y"].tolist() == [[3.0, 3.0]]
    collector = otel.collector

    def spans(model: str) -> list:
        return collector.find(lambda s: attributes(s.attributes).get("request_id") == "otel-bls"
                              and attributes(s.attributes).get("model_name") == model)

    wait_for(lambda: spans("bls_caller") and spans("gated"), what="the caller's span and its BLS call's")
    [caller], [called] = spans("bls_caller"), spans("gated")
    assert caller.parent_span_id.hex() == GRPC_PARENT and called.trace_id.hex() == TRACE_ID
    assert called.name == "infer gated" and called.parent_span_id == caller.span_id
    assert attributes(called.attributes)["parent_id"] == attributes(caller.attributes)["trace_id"]
    assert {"REQUEST_START", "QUEUE_START", "COMPUTE_START", "REQUEST_END"} <= {e.name for e in called.events}
    assert caller.start_time_unix_nano <= called.start_time_unix_nano <= called.end_time_unix_nano
    wait_for(lambda: {"queue", "compute"} <= set(children(collector, called)), what="the BLS call's queue and compute")


def test_a_collector_that_is_down_costs_no_request(otel):
    """Runs last: the collector goes away, serving goes on and the spans that could not go are counted."""
    assert (otel.metric("ferry_trace_spans_dropped") or 0) == 0
    otel.collector.stop()
    for i in range(20):
        assert kserve.outputs(gated_infer(otel, f"after-{i}"))["Y"].tolist() == [[1.0, 1.0]]
    wait_for(lambda: (otel.metric("ferry_trace_spans_dropped") or 0) > 0, timeout_s=120, what="dropped spans counted")
    assert otel.metric("ferry_trace_spans_exported") > 0

