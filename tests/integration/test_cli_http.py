"""`ferry models|health|infer|generate --url http://...`: the same answers through the HTTP front door as
through gRPC, from subprocesses against one real server; the server's HTTP request counter shows each
command really went over HTTP."""

from __future__ import annotations

import json
import socket

import numpy as np
import pytest

from tests import builders
from tests.conftest import RunningServer, link_shipped_models
from tests.integration.test_cli import A, B, ferry


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "tiny_llama")
    skip = tuple(t for t in builders.ONNX_TYPES if t not in ("BYTES", "INT64"))
    builders.identity_all_types(repo / "words" / "1" / "model.onnx", skip=skip)
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    server = RunningServer(repo)
    yield server
    server.stop()


def http_calls(server, endpoint: str) -> float:
    return sum(server.metric("ferry_http_requests", endpoint=endpoint, status=status) or 0
               for status in ("200", "400", "404"))


def both(server, *args: str) -> tuple:
    """The command over gRPC and over HTTP; both must succeed."""
    by_grpc = ferry(*args, "--url", server.address)
    by_http = ferry(*args, "--url", server.http_url)
    assert by_grpc.returncode == 0, by_grpc.stderr
    assert by_http.returncode == 0, by_http.stderr
    return by_grpc, by_http


def test_models_over_http(server):
    before = http_calls(server, "repository_index")
    by_grpc, by_http = both(server, "models", "--json")
    assert json.loads(by_http.stdout) == json.loads(by_grpc.stdout)
    rows = {m["name"]: m for m in json.loads(by_http.stdout)}
    assert rows["simple"]["state"] == "READY" and rows["broken"]["state"] == "UNAVAILABLE" and rows["broken"]["reason"]
    table = ferry("models", "--url", server.http_url, "--ready")
    assert table.returncode == 0 and table.stdout.splitlines()[0].split() == ["NAME", "VERSION", "STATE", "REASON"]
    assert "broken" not in table.stdout and "simple" in table.stdout
    assert http_calls(server, "repository_index") == before + 2


def test_health_over_http(server):
    before = http_calls(server, "model_ready")
    done = ferry("health", "--url", server.http_url, "--model", "simple")
    assert done.returncode == 0, done.stderr
    assert f"at {server.http_url}: live yes, ready yes" in done.stdout and "model simple: ready yes" in done.stdout
    report = json.loads(ferry("health", "--url", server.http_url, "--json", "--model", "simple").stdout)
    assert report["live"] is True and report["ready"] is True and report["models"] == {"simple": True}
    assert report["server"]["name"] == "ferry" and "binary_tensor_data" in report["server"]["extensions"]
    unknown = ferry("health", "--url", server.http_url, "--model", "nope")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr and "nope" in unknown.stderr
    assert http_calls(server, "model_ready") == before + 3
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    down = ferry("health", "--url", closed)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_infer_over_http_matches_grpc(server, tmp_path):
    before = http_calls(server, "infer")
    args = ["infer", "simple", "--input", f"INPUT0={A.tolist()}", "--input", f"INPUT1={B.tolist()}", "--json"]
    by_grpc, by_http = both(server, *args)
    outputs = json.loads(by_http.stdout)["outputs"]
    assert outputs == json.loads(by_grpc.stdout)["outputs"]
    assert outputs["OUTPUT0"]["data"] == (A + B).tolist() and outputs["OUTPUT1"]["data"] == (A - B).tolist()
    only = ferry(*args, "--output", "OUTPUT1", "--url", server.http_url)
    assert list(json.loads(only.stdout)["outputs"]) == ["OUTPUT1"]
    saved = ferry("infer", "words", "--url", server.http_url, "--input", 'IN_BYTES=[["ferry", "caf\u00e9", ""]]',
                  "--input", "IN_INT64=[[1, -2, 3]]", "--save", str(tmp_path))
    assert saved.returncode == 0, saved.stderr
    words = np.load(tmp_path / "OUT_BYTES.npy", allow_pickle=True)
    assert words.tolist() == [[b"ferry", "caf\u00e9".encode(), b""]]
    np.testing.assert_array_equal(np.load(tmp_path / "OUT_INT64.npy"), np.array([[1, -2, 3]], np.int64))
    wrong = ferry("infer", "simple", "--url", server.http_url, "--input", "INPUT0=[[1, 2]]", "--input", "INPUT1=[[1, 2]]")
    assert wrong.returncode == 1 and "INVALID_ARGUMENT" in wrong.stderr
    assert http_calls(server, "infer") == before + 4


def test_generate_over_http_streams_the_same_text(server):
    before = http_calls(server, "generate_stream")
    args = ["generate", "tiny_llama", "the ferry leaves", "--max-tokens", "10", "--ignore-eos"]
    by_grpc, by_http = both(server, *args)
    assert by_http.stdout == by_grpc.stdout and len(by_http.stdout) > 1  # greedy by default on both doors
    assert "finish: length" in by_http.stderr and "+ 10 completion" in by_http.stderr
    lines = [json.loads(line) for line in ferry(*args, "--json", "--url", server.http_url).stdout.splitlines()]
    assert "".join(line["text"] for line in lines) + "\n" == by_grpc.stdout
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["usage"]["completion_tokens"] == 10
    refused = ferry("generate", "simple", "hello", "--url", server.http_url)
    assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr and "not a generation model" in refused.stderr
    assert http_calls(server, "generate_stream") == before + 3


def test_perf_refuses_an_http_url(server):
    done = ferry("perf", "simple", "--url", server.http_url, "--requests", "1")
    assert done.returncode == 2 and "gRPC" in done.stderr
