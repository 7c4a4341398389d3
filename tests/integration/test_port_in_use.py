"""A port `ferry serve` needs is already taken: one line naming the service and the address, a non-zero
exit, no traceback, and no model loaded (as Triton ends: "failed to start ... service")."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.conftest import ROOT, RunningServer

# A model that leaves a file behind when it loads: the test sees whether loading began.
MARKER_MODEL = '''
import numpy as np


class Model:
    def initialize(self, args):
        open(args["config"]["parameters"]["marker"]["string_value"], "w").close()

    def execute(self, inputs):
        return {"Y": inputs["X"]}
'''


@pytest.fixture
def repo(tmp_path):
    folder = tmp_path / "repo" / "marked"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(MARKER_MODEL)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 4\ninput: [{name: X, data_type: TYPE_FP32, dims: [2]}]\n"
        "output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]\n"
        f"parameters: {{marker: {{string_value: '{tmp_path / 'loaded'}'}}}}\n")
    return tmp_path


@pytest.mark.parametrize("flag, service, extra", [
    ("--grpc-port", "gRPC", ()), ("--http-port", "HTTP", ()), ("--metrics-port", "metrics", ()),
    ("--grpc-port", "gRPC", ("--frontend-processes", "2")),
], ids=["grpc", "http", "metrics", "frontend-processes"])
def test_a_taken_port_ends_the_start_in_one_line(repo, flag, service, extra):
    with socket.socket() as holder:  # a plain listener, as another program's would be
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--grpc-port": "0", "--http-port": "0", "--metrics-port": "0", flag: str(port)}
        cmd = [sys.executable, "-m", "server", "serve", "--model-repository", str(repo / "repo"),
               *(x for pair in ports.items() for x in pair), *extra]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "Traceback" not in said and "Exception ignored" not in said, said
    lines = [line for line in said.splitlines() if f"127.0.0.1:{port}" in line]
    assert lines == [f"ferry: cannot serve {service} on 127.0.0.1:{port}: address already in use"], said
    assert "ferry: serving" not in done.stdout and "ferry: ready" not in done.stdout  # nothing was announced
    assert not (repo / "loaded").exists()  # the model never began to load


def test_the_marker_model_loads_when_the_ports_are_free(repo):
    """The control: with free ports the same repository loads, so the test above sees a start that stopped."""
    server = RunningServer(repo / "repo")
    try:
        assert (repo / "loaded").exists()
    finally:
        assert server.stop() == 0
