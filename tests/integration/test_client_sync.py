"""The blocking Python client (clients.InferenceClient) against a real server: every call, every error path."""

from __future__ import annotations

import socket
import threading

import grpc
import numpy as np
import pytest

from clients import FerryClientError, InferenceClient
from tests.kserve import ALL_TYPES
from tests.conftest import serve_client_test_models



@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = serve_client_test_models(tmp_path_factory.mktemp("repo"))
    yield server
    server.gate.touch()  # never leave an execution waiting while the server drains
    server.stop()


@pytest.fixture
def client(server):
    with InferenceClient(server.address, timeout_s=60) as client:
        yield client


def test_health_metadata_config_and_index(client):
    assert client.is_live() and client.is_ready()
    meta = client.server_metadata()
    assert meta.name == "ferry" and "statistics" in meta.extensions
    assert client.is_model_ready("simple") and client.is_model_ready("simple", version="1")
    simple = client.model_metadata("simple")
    assert simple.name == "simple" and simple.versions == ("1",) and simple.platform == "onnxruntime_onnx"
    assert [(t.name, t.datatype, t.shape) for t in simple.inputs] == [
        ("INPUT0", "FP32", (-1, 16)), ("INPUT1", "FP32", (-1, 16))]
    assert [t.name for t in simple.outputs] == ["OUTPUT0", "OUTPUT1"]
    config = client.model_config("classifier")
    assert config.max_batch_size == 32 and config.instance_group[0].count == 2  # classifier's config.pbtxt
    index = {(m.name, m.state) for m in client.repository_index()}
    assert {("simple", "READY"), ("classifier", "READY"), ("types", "READY")} <= index
    assert {m.name for m in client.repository_index(ready_only=True)} == {name for name, _ in index}


def test_infer_sends_and_returns_raw_tensors(client):
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 0.5, np.float32)
    before = sum(s.inference_count for s in client.model_statistics("simple"))
    out = client.infer("simple", {"INPUT0": a, "INPUT1": b}, request_id="r1", parameters={"priority": 1})
    np.testing.assert_array_equal(out["OUTPUT0"], a + b)
    np.testing.assert_array_equal(out["OUTPUT1"], a - b)
    assert out["OUTPUT0"].dtype == np.float32 and out["OUTPUT0"].shape == (2, 16)
    only = client.infer("simple", {"INPUT0": a, "INPUT1": b}, outputs=["OUTPUT1"])
    assert list(only) == ["OUTPUT1"]
    stats = client.model_statistics("simple")
    assert [s.name for s in stats] == ["simple"] and stats[0].inference_count == before + 4  # rows, two calls
    assert {s.name for s in client.model_statistics()} >= {"simple", "classifier", "types"}


def test_every_datatype_round_trips(client):
    out = client.infer("types", {f"IN_{t}": v for t, v in ALL_TYPES.items()})
    for datatype, value in ALL_TYPES.items():
        got = out[f"OUT_{datatype}"]
        assert got.shape == value.shape and got.dtype == value.dtype, datatype
        assert got.tolist() == value.tolist(), datatype


def test_unicode_and_big_endian_arrays_are_converted_for_the_wire(client):
    inputs = {f"IN_{t}": v[:, :2] for t, v in ALL_TYPES.items()}
    inputs["IN_BYTES"] = np.array([["ferry", "été"]])  # numpy unicode travels as UTF-8 BYTES
    inputs["IN_INT32"] = np.array([[7, -3]], dtype=">i4")  # numpy big-endian travels little-endian
    out = client.infer("types", inputs, outputs=["OUT_BYTES", "OUT_INT32"])
    assert list(out) == ["OUT_BYTES", "OUT_INT32"]
    assert out["OUT_BYTES"].tolist() == [[b"ferry", "été".encode()]]
    assert out["OUT_INT32"].tolist() == [[7, -3]]


def test_errors_carry_status_and_server_message(client):
    a = np.ones((1, 16), np.float32)
    cases = [
        (lambda: client.infer("nope", {"INPUT0": a}), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: client.infer("simple", {"INPUT0": a}), grpc.StatusCode.INVALID_ARGUMENT, "INPUT1"),
        (lambda: client.infer("simple", {"INPUT0": a, "INPUT1": np.ones((1, 3), np.float32)}),
         grpc.StatusCode.INVALID_ARGUMENT, "INPUT1"),
        (lambda: client.model_metadata("nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: client.is_model_ready("nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: client.load_model("nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: client.unload_model("nope"), grpc.StatusCode.NOT_FOUND, "nope"),
    ]
    for call, status, words in cases:
        with pytest.raises(FerryClientError) as info:
            call()
        assert info.value.status == status and words in info.value.message
        assert str(info.value).startswith(status.name)


def test_unload_then_load_a_model(client):
    client.unload_model("classifier")
    assert not client.is_model_ready("classifier")
    with pytest.raises(FerryClientError) as info:
        client.infer("classifier", {"features": np.ones((1, 32), np.float32)})
    assert info.value.status == grpc.StatusCode.UNAVAILABLE
    client.load_model("classifier")
    assert client.is_model_ready("classifier")
    assert client.infer("classifier", {"features": np.ones((1, 32), np.float32)})["probabilities"].shape == (1, 4)


def test_per_call_timeout_overrides_the_clients_default(server):
    held = {"X": np.full((1, 2), -1, np.float32)}  # the gated model holds it until the gate file exists
    with InferenceClient(server.address, timeout_s=60) as patient:
        with pytest.raises(FerryClientError) as info:
            patient.infer("gated", held, timeout_s=0.3)
        assert info.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
    with InferenceClient(server.address, timeout_s=0.3) as hasty:
        with pytest.raises(FerryClientError) as info:
            hasty.infer("gated", held)
        assert info.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
        opener = threading.Timer(1.0, server.gate.touch)  # well past the client's 0.3 s default
        opener.start()
        out = hasty.infer("gated", held, timeout_s=60)
        opener.join()
    assert out["Y"].tolist() == [[-1, -1]]


def test_no_server_is_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the client dials it
    with InferenceClient(f"127.0.0.1:{port}", timeout_s=30) as client, pytest.raises(FerryClientError) as info:
        client.is_live()
    assert info.value.status == grpc.StatusCode.UNAVAILABLE


def test_generate_errors_surface_from_the_stream(client):
    with pytest.raises(FerryClientError) as info:
        list(client.generate("simple", "hello", max_tokens=4))
    assert info.value.status == grpc.StatusCode.INVALID_ARGUMENT and "not a generation model" in info.value.message
    with pytest.raises(FerryClientError) as info:
        next(client.generate("nope", "hello"))
    assert info.value.status == grpc.StatusCode.NOT_FOUND
    with pytest.raises(TypeError, match="max_token"):
        client.generate("simple", "hello", max_token=4)


def test_generate_streams_deltas_then_usage(client):
    deltas = list(client.generate("tiny_llama", "the ferry leaves", max_tokens=12, ignore_eos=True, request_id="g1"))
    assert len(deltas) > 1 and all(not d.last for d in deltas[:-1])
    final = deltas[-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == 12
    assert sum(len(d.token_ids) for d in deltas) == 12 and final.usage.prompt_tokens > 0
    assert final.timings.total_ms >= final.timings.time_to_first_token_ms > 0
    again = list(client.generate("tiny_llama", "the ferry leaves", max_tokens=12, ignore_eos=True))
    assert "".join(d.text for d in again) == "".join(d.text for d in deltas)  # greedy by default: same text
    ids = [t for d in deltas for t in d.token_ids]
    from_ids = list(client.generate("tiny_llama", ids[:5], max_tokens=3, ignore_eos=True))
    assert from_ids[-1].usage.prompt_tokens == 5 and from_ids[-1].usage.completion_tokens == 3


def test_leaving_a_stream_early_cancels_it(client):
    stream = client.generate("tiny_llama", "the ferry", max_tokens=200, ignore_eos=True)
    first = next(stream)
    assert not first.last
    stream.close()  # what breaking out of a for loop does: the RPC is cancelled
    tail = list(client.generate("tiny_llama", "the ferry", max_tokens=2, ignore_eos=True))
    assert tail[-1].usage.completion_tokens == 2
