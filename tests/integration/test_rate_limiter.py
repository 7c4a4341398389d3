"""Triton's rate limiter (--rate-limit execution_count): instances run only while the resources their
instance group declares are free, and the waiting instance with the better priority goes first."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tests import kserve
from tests.conftest import RunningServer, wait_for

# Each execution leaves a mark while it runs and notes how many other executions' marks it saw.
MARKING_MODEL = '''
import json, os, time


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name, params = config["name"], config["parameters"]
        self.folder = params["folder"]["string_value"]
        self.gate = params.get("gate", {}).get("string_value")

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils
        mine = os.path.join(self.folder, f"running.{self.name}.{os.getpid()}.{time.monotonic_ns()}")
        open(mine, "w").close()
        others = [f for f in os.listdir(self.folder) if f.startswith("running.") and f != os.path.basename(mine)]
        with open(os.path.join(self.folder, "log"), "a") as log:
            log.write(f"{self.name} {len(others)}\\n")
        if self.gate:
            deadline = time.monotonic() + 120
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        else:
            time.sleep(0.01)
        os.remove(mine)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)])
                for r in requests]
'''


def marking_model(repo, name: str, folder, priority: int = 0, gate=None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MARKING_MODEL)
    params = {"folder": str(folder), **({"gate": str(gate)} if gate else {})}
    (repo / name / "config.pbtxt").write_text(f"""
backend: "python"
max_batch_size: 4
input [{{name: "X", data_type: TYPE_FP32, dims: [1]}}]
output [{{name: "Y", data_type: TYPE_FP32, dims: [1]}}]
instance_group [{{kind: KIND_CPU, count: 1, rate_limiter {{resources [{{name: "R", count: 1}}] priority: {priority}}}}}]
parameters [{", ".join(f'{{key: "{k}", value: {{string_value: "{v}"}}}}' for k, v in params.items())}]
""")


def executions(folder) -> list[tuple[str, int]]:
    path = folder / "log"
    if not path.exists():
        return []
    return [(name, int(seen)) for name, seen in (line.split() for line in path.read_text().splitlines())]


def test_two_models_sharing_a_resource_of_one_never_run_at_once(tmp_path):
    repo, folder = tmp_path / "repo", tmp_path / "marks"
    folder.mkdir()
    for name in ("a", "b"):
        marking_model(repo, name, folder)
    server = RunningServer(repo, "--rate-limit", "execution_count")
    x = np.array([[1.0]], np.float32)
    try:
        with ThreadPoolExecutor(16) as pool:
            answers = [pool.submit(kserve.infer, server.channel, name, {"X": x}) for _ in range(20) for name in ("a", "b")]
            for answer in answers:
                np.testing.assert_array_equal(answer.result()["Y"], x + 1)
        ran = executions(folder)
        assert {name for name, _ in ran} == {"a", "b"}
        assert [seen for _, seen in ran] == [0] * len(ran)  # no execution ever saw another one running
    finally:
        server.stop()


def test_the_better_priority_runs_first_when_the_resource_frees(tmp_path):
    repo, folder, gate = tmp_path / "repo", tmp_path / "marks", tmp_path / "gate"
    folder.mkdir()
    marking_model(repo, "holder", folder, priority=1, gate=gate)
    marking_model(repo, "low", folder, priority=5)
    marking_model(repo, "high", folder, priority=1)
    server = RunningServer(repo, "--rate-limit", "execution_count", "--rate-limit-resource", "R:1")
    x = np.array([[1.0]], np.float32)
    try:
        with ThreadPoolExecutor(3) as pool:
            held = pool.submit(kserve.infer, server.channel, "holder", {"X": x})
            wait_for(lambda: executions(folder) == [("holder", 0)], 60, "the holder to run")
            low = pool.submit(kserve.infer, server.channel, "low", {"X": x})  # waits first, for the resource
            server.wait_for_metric("nv_inference_pending_request_count", 1, timeout_s=60, model="low", version="1")
            high = pool.submit(kserve.infer, server.channel, "high", {"X": x})
            server.wait_for_metric("nv_inference_pending_request_count", 1, timeout_s=60, model="high", version="1")
            gate.touch()
            for answer in (held, low, high):
                np.testing.assert_array_equal(answer.result()["Y"], x + 1)
        assert [name for name, _ in executions(folder)] == ["holder", "high", "low"]
    finally:
        gate.touch()
        server.stop()
