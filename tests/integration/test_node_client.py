"""The Node.js example (clients/node/client.js, @grpc/grpc-js over protos/) gives what the Python client gives."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from clients import InferenceClient
from tests.conftest import ROOT, RunningServer, link_shipped_models

NODE_DIR = ROOT / "clients" / "node"

if shutil.which("node") is None or shutil.which("npm") is None:
    pytest.skip(reason="Node.js (node and npm) is not installed; the Node example client needs it", allow_module_level=True)


@pytest.fixture(scope="module")
def node_ready():
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        done = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=False,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm ci failed in {NODE_DIR}:\n{done.stdout}\n{done.stderr}"


@pytest.fixture(scope="module")
def server(node_ready, tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "classifier", "tiny_llama")
    server = RunningServer(repo)
    yield server
    server.stop()


def node(server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(NODE_DIR / "client.js"), "--url", server.address, *args], check=False,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("model", ["simple", "classifier"])
def test_node_model_infer_matches_the_python_client(server, model):
    done = node(server, "infer", model)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    with InferenceClient(server.address, timeout_s=60) as client:
        meta = client.model_metadata(model)
        # the example's inputs: input k holds (k + 1) * [0, 1, 2, ...] with variable dimensions set to 1
        inputs = {}
        for k, spec in enumerate(meta.inputs):
            shape = tuple(1 if d < 0 else d for d in spec.shape)
            inputs[spec.name] = ((k + 1) * np.arange(np.prod(shape))).reshape(shape).astype(np.float32)
        expected = client.infer(model, inputs)
    assert result["model"] == model and set(result["outputs"]) == set(expected)
    for name, array in expected.items():
        got = result["outputs"][name]
        assert got["datatype"] == "FP32" and got["shape"] == list(array.shape)
        # exact: the same request to the same model on this server, only the client differs
        np.testing.assert_array_equal(np.array(got["data"], np.float32).reshape(array.shape), array)
    if model == "simple":
        np.testing.assert_array_equal(expected["OUTPUT0"], 3 * np.arange(16, dtype=np.float32).reshape(1, 16))


def test_node_reports_grpc_errors(server):
    done = node(server, "infer", "nope")
    assert done.returncode == 1 and "NOT_FOUND" in done.stderr and "nope" in done.stderr


def test_node_generate_streams_what_the_python_client_streams(server):
    done = node(server, "generate", "tiny_llama", "the ferry leaves", "--max-tokens", "12")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stderr.strip().splitlines()[-1])
    with InferenceClient(server.address, timeout_s=120) as client:
        deltas = list(client.generate("tiny_llama", "the ferry leaves", max_tokens=12))  # greedy by default
    assert done.stdout == "".join(d.text for d in deltas) + "\n"
    assert summary["token_ids"] == [t for d in deltas for t in d.token_ids]
    assert summary["finish_reason"] == deltas[-1].finish_reason
    assert summary["usage"]["completion_tokens"] == deltas[-1].usage.completion_tokens == len(summary["token_ids"])
