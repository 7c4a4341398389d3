"""The front end's load as operators and the adaptive window see it: `ferry_frontend_loop_busy_ratio`."""

from __future__ import annotations


import numpy as np

from tests import builders, kserve
from tests.conftest import RunningServer, wait_for


def test_the_event_loops_busy_share_is_on_the_metrics_page(tmp_path):
    repo = tmp_path / "repo"
    builders.mlp(repo / "mlp" / "1" / "model.onnx")
    (repo / "mlp" / "config.yaml").write_text("max_batch_size: 8\ndynamic_batching: {latency_target_ms: 50}\n")
    server = RunningServer(repo)
    try:
        stub = kserve.stub(server.channel)
        x = np.ones((1, 16), np.float32)
        for _ in range(20):
            stub.ModelInfer(kserve.request("mlp", {"X": x}), timeout=60)
        # the figure is refreshed every 0.1 s of loop time; wait generously for the first one
        wait_for(lambda: server.metric("ferry_frontend_loop_busy_ratio") is not None, 30,
                 "the loop's busy share on /metrics")
        busy = server.metric("ferry_frontend_loop_busy_ratio")
        assert 0.0 <= busy <= 1.0
        assert server.metric("nv_inference_request_success", model="mlp", version="1") == 20
    finally:
        server.stop()
