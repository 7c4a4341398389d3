"""`ferry models|health|infer|generate`, run as subprocesses against a real server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from clients import InferenceClient
from tests.conftest import ROOT, RunningServer, link_shipped_models

A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 2, np.float32)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "classifier", "tiny_llama")
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    server = RunningServer(repo)
    yield server
    server.stop()


def ferry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", *args], cwd=ROOT, check=False, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONIOENCODING": "utf-8"})


def test_help_lists_the_client_commands():
    done = ferry("--help")
    assert done.returncode == 0
    for command in ("serve", "models", "health", "infer", "generate", "perf"):
        assert command in done.stdout


def test_models_shows_state_and_reason(server):
    with InferenceClient(server.address) as client:
        index = client.repository_index()
    broken = next(m for m in index if m.name == "broken")
    assert broken.state == "UNAVAILABLE" and broken.reason
    done = ferry("models", "--url", server.address)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["NAME", "VERSION", "STATE", "REASON"] and len(lines) == 1 + len(index)
    rows = {line.split()[0]: line for line in lines[1:]}
    assert rows["simple"].split() == ["simple", "1", "READY"]  # a ready version's reason is empty, as Triton's
    assert rows["broken"].split()[2] == "UNAVAILABLE" and broken.reason.splitlines()[0][:40] in rows["broken"]
    as_json = json.loads(ferry("models", "--url", server.address, "--json").stdout)
    assert as_json == [{"name": m.name, "version": m.version, "state": m.state, "reason": m.reason} for m in index]
    ready = json.loads(ferry("models", "--url", server.address, "--json", "--ready").stdout)
    assert {m["name"] for m in ready} == {m.name for m in index if m.state == "READY"}


def test_health(server):
    done = ferry("health", "--url", server.address, "--model", "simple", "--model", "classifier")
    assert done.returncode == 0, done.stderr
    assert f"at {server.address}: live yes, ready yes" in done.stdout
    assert "model simple: ready yes" in done.stdout and "statistics" in done.stdout
    report = json.loads(ferry("health", "--url", server.address, "--json", "--model", "simple").stdout)
    assert report["live"] is True and report["ready"] is True and report["models"] == {"simple": True}
    assert report["server"]["name"] == "ferry"
    unknown = ferry("health", "--url", server.address, "--model", "nope")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr and "nope" in unknown.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    down = ferry("health", "--url", closed)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_infer_with_json_literals(server):
    args = ["infer", "simple", "--url", server.address, "--input", f"INPUT0={A.tolist()}",
            "--input", f"INPUT1={B.tolist()}"]
    done = ferry(*args)
    assert done.returncode == 0, done.stderr
    assert "OUTPUT0 FP32 [1, 16]" in done.stdout and "OUTPUT1 FP32 [1, 16]" in done.stdout
    assert " 17." in done.stdout  # 15 + 2, printed by numpy
    outputs = json.loads(ferry(*args, "--json").stdout)["outputs"]
    assert outputs["OUTPUT0"]["datatype"] == "FP32" and outputs["OUTPUT0"]["shape"] == [1, 16]
    assert outputs["OUTPUT0"]["data"] == (A + B).tolist() and outputs["OUTPUT1"]["data"] == (A - B).tolist()
    only = json.loads(ferry(*args, "--json", "--output", "OUTPUT1").stdout)["outputs"]
    assert list(only) == ["OUTPUT1"]


def test_infer_with_npy_files_and_saved_outputs(server, tmp_path):
    np.save(tmp_path / "a.npy", A)
    np.save(tmp_path / "b.npy", B.astype(np.float64))  # cast to the model's FP32
    done = ferry("infer", "simple", "--url", server.address, "--input", f"INPUT0={tmp_path / 'a.npy'}",
                 "--input", f"INPUT1={tmp_path / 'b.npy'}", "--save", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'out' / 'OUTPUT0.npy'}" in done.stdout
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "OUTPUT0.npy"), A + B)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "OUTPUT1.npy"), A - B)


@pytest.mark.parametrize("inputs, code, words", [
    (["X=[[1]]"], 2, "no input 'X'"),
    (["INPUT0=not json"], 2, "neither a JSON literal nor a .npy file"),
    (["INPUT0=[[1, 2]]", "INPUT1=[[1, 2]]"], 1, "INVALID_ARGUMENT"),  # the server's own message
])
def test_infer_errors(server, inputs, code, words):
    done = ferry("infer", "simple", "--url", server.address, *[a for i in inputs for a in ("--input", i)])
    assert done.returncode == code and words in done.stderr


def test_generate_streams_text_then_a_summary(server):
    with InferenceClient(server.address, timeout_s=120) as client:
        deltas = list(client.generate("tiny_llama", "the ferry leaves", max_tokens=10, ignore_eos=True))
    text = "".join(d.text for d in deltas)
    args = ["generate", "tiny_llama", "the ferry leaves", "--url", server.address, "--max-tokens", "10", "--ignore-eos"]
    done = ferry(*args)
    assert done.returncode == 0, done.stderr
    assert done.stdout == text + "\n"  # greedy by default, so the same text as the client's
    assert "finish: length" in done.stderr and "+ 10 completion" in done.stderr
    lines = [json.loads(line) for line in ferry(*args, "--json").stdout.splitlines()]
    assert len(lines) == len(deltas) and "".join(line["text"] for line in lines) == text
    assert lines[-1]["finish_reason"] == "length" and lines[-1]["usage"]["completion_tokens"] == 10
    assert sum(len(line["token_ids"]) for line in lines) == 10


def test_generate_error_is_reported(server):
    done = ferry("generate", "simple", "hello", "--url", server.address)
    assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr and "not a generation model" in done.stderr
