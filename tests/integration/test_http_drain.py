"""Drain over HTTP: after SIGTERM a new HTTP call gets 503 with a JSON error (KServe's shape on /v2,
OpenAI's on /v1) while the probes still answer; the request admitted before SIGTERM completes, then the
server exits 0.

An admitted request is held by a gated python model (its execution waits for a file the test creates),
so the server is certainly still draining while the test calls it, however slow the machine is.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

from tests import builders
from tests.conftest import RunningServer

HELD = {"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [-1, -1]}]}  # negative: waits at the gate
FRESH = {"inputs": [{"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1, 1]}]}


def call(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_for(predicate, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_http_answers_503_while_draining_and_the_admitted_request_completes(tmp_path):
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path / "repo", "gated", gate=gate, max_batch_size=1)
    server = RunningServer(tmp_path / "repo", "--drain-grace-seconds", "120")
    url = server.http_url
    held: dict = {}
    worker = threading.Thread(target=lambda: held.update(answer=call(f"{url}/v2/models/gated/infer", HELD)))
    try:
        assert call(f"{url}/v2/models/gated/infer", FRESH)[0] == 200  # served before the drain
        assert call(f"{url}/health") == (200, b"") and call(f"{url}/ping") == (200, b"")  # vLLM's probes
        assert call(f"{url}/ping", {})[0] == 200  # POST too, as SageMaker calls it
        status, body = call(f"{url}/version")
        assert status == 200 and json.loads(body)["version"]
        worker.start()
        wait_for((tmp_path / "gate.running").exists, "the held request to start executing")
        server.proc.send_signal(signal.SIGTERM)
        # readiness drops in the same step that closes the doors, so from here every call is refused
        wait_for(lambda: call(f"{url}/v2/health/ready")[0] == 400, "readiness to drop after SIGTERM")

        status, body = call(f"{url}/v2/models/gated/infer", FRESH)
        assert status == 503 and "shutting down" in json.loads(body)["error"]
        status, body = call(f"{url}/v2/models/gated")
        assert status == 503 and "shutting down" in json.loads(body)["error"]
        status, body = call(f"{url}/v1/models")
        error = json.loads(body)["error"]
        assert status == 503 and error["code"] == 503 and "shutting down" in error["message"]
        assert call(f"{url}/v2/health/live")[0] == 200  # draining: out of rotation, not dead
        assert call(f"{url}/health")[0] == 503 and call(f"{url}/ping")[0] == 503  # out of a balancer's rotation
        assert worker.is_alive() and server.proc.poll() is None  # the held request keeps the drain going
    finally:
        gate.touch()
    try:
        worker.join(120)
        status, body = held["answer"]
        assert status == 200, body
        assert json.loads(body)["outputs"][0]["data"] == [-1, -1]
        assert server.proc.wait(60) == 0
        wait_for(lambda: "ferry: stopped" in server.output, "the server's last line to be read")
    finally:
        server.stop()
