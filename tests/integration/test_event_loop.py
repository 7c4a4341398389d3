"""`--event-loop`: uvloop unless asked otherwise, and asyncio's own loop on request, engine and front ends
alike. The rest of the suite runs on the default; here the standard library's loop must serve the same
answers and the same errors, with a front-end process on it too."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from tests import builders, kserve
from tests.conftest import RunningServer, wait_for
from tests.integration.test_frontend_processes import _all_types


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repo = tmp_path_factory.mktemp("loops") / "repo"
    builders.identity_all_types(repo / "types" / "1" / "model.onnx")
    (repo / "types" / "config.yaml").write_text("max_batch_size: 16\ndynamic_batching: {max_queue_delay_microseconds: 2000}\n")
    started = {}
    try:
        started["default"] = RunningServer(repo)
        started["asyncio"] = RunningServer(repo, "--event-loop", "asyncio", "--frontend-processes", "2")
        yield started
    finally:
        for server in started.values():
            assert server.stop() == 0, server.output


def test_the_default_is_uvloop_and_asyncio_runs_when_asked(servers):
    assert re.search(r"event loop: uvloop \d", servers["default"].output), servers["default"].output
    plain = servers["asyncio"]
    assert "ferry: event loop: asyncio" in plain.output
    wait_for(lambda: all(f"front end {i}: event loop: asyncio" in plain.output for i in (1, 2)), 60,
             "both front ends to say which loop they run")
    assert "uvloop" not in plain.output


def _exchange(server: RunningServer) -> tuple[list, tuple]:
    """Sixteen concurrent requests (batched together) with one malformed among them: the answers, and the
    malformed request's status."""
    inputs = _all_types(2, 3)
    stub = kserve.stub(server.channel)
    bad = kserve.request("types", {**inputs, "IN_FP32": np.ones((2, 3), np.float64)})  # the wrong datatype

    def call(i):
        try:
            return kserve.outputs(stub.ModelInfer(bad if i == 7 else kserve.request("types", inputs), timeout=60))
        except grpc.RpcError as err:
            return err.code(), err.details()

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    return results[:7] + results[8:], results[7]


@pytest.mark.parametrize("loop", ["default", "asyncio"])
def test_each_loop_answers_and_refuses_alike(servers, loop):
    answers, refused = _exchange(servers[loop])
    inputs = _all_types(2, 3)
    for outputs in answers:
        assert isinstance(outputs, dict), outputs
        for name, array in inputs.items():
            np.testing.assert_array_equal(outputs[name.replace("IN_", "OUT_")], array)
    reference = _exchange(servers["default"])[1]
    assert refused[0] == grpc.StatusCode.INVALID_ARGUMENT and refused == reference
