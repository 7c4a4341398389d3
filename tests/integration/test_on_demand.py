"""On-demand model control under a memory budget: models load on their first request, least recently
used idle ones are evicted, and the server's accounting stays within the budget (docs/many-models.md)."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from onnx import TensorProto, helper

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, wait_for

WIDTH = 512  # each model holds a WIDTH x WIDTH float32 weight: 1 MiB on disk and in memory
MODEL_MIB = 10  # what each declares (memory_bytes): five fit in the budget
BUDGET = "50MiB"
X = np.linspace(-1, 1, 2 * WIDTH, dtype=np.float32).reshape(2, WIDTH)


def weight(seed: int, width: int = WIDTH) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((width, width)).astype(np.float32)


def matmul_model(folder, seed: int, parameters: dict[str, str | None] | None = None, width: int = WIDTH) -> None:
    """Y = X W, W seeded: every model answers differently, and its weight is a real allocation."""
    w = helper.make_tensor("W", TensorProto.FLOAT, [width, width], weight(seed, width).ravel())
    builders.save_onnx([helper.make_node("MatMul", ["X", "W"], ["Y"])],
                       [builders.tensor("X", TensorProto.FLOAT, ["batch", width])],
                       [builders.tensor("Y", TensorProto.FLOAT, ["batch", width])], folder / "1" / "model.onnx", [w])
    params = {k: v for k, v in {"memory_bytes": f"{MODEL_MIB}MiB", **(parameters or {})}.items() if v is not None}
    (folder / "config.yaml").write_text("max_batch_size: 8\nparameters: {" +
                                        ", ".join(f"{k}: {{string_value: '{v}'}}" for k, v in params.items()) + "}\n")


SLOW_LOAD = '''
import os, time
import numpy as np


class TritonPythonModel:
    def initialize(self, args):
        import json
        params = json.loads(args["model_config"])["parameters"]
        gate, fail = params["gate"]["string_value"], params.get("fail", {}).get("string_value")
        deadline = time.monotonic() + 120  # a forgotten gate does not hold the server forever
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        if fail:
            raise RuntimeError(fail)

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
                for r in requests]
'''


BUSY_EXECUTE = '''
import os, pathlib, time


class TritonPythonModel:
    def initialize(self, args):
        import json
        params = json.loads(args["model_config"])["parameters"]
        self.started, self.gate = params["started"]["string_value"], params["gate"]["string_value"]

    def execute(self, requests):
        import triton_python_backend_utils as pb_utils
        pathlib.Path(self.started).touch()
        deadline = time.monotonic() + 120  # a forgotten gate does not hold the server forever
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 2)])
                for r in requests]
'''


def busy_model(folder, started, gate) -> None:
    """A python model (10 MiB declared) whose execute says it `started`, then holds until `gate` exists."""
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(BUSY_EXECUTE)
    params = {"started": str(started), "gate": str(gate), "memory_bytes": f"{MODEL_MIB}MiB"}
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 8\ninput: [{name: X, data_type: TYPE_FP32, dims: [2]}]\n"
        "output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]\nparameters: {"
        + ", ".join(f"{k}: {{string_value: '{v}'}}" for k, v in params.items()) + "}\n")


def slow_load_model(folder, gate, fail: str = "") -> None:
    """A python model whose load waits for `gate` (a file the test creates), then fails with `fail` if given."""
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(SLOW_LOAD)
    params = {"gate": str(gate), "memory_bytes": "1MiB", **({"fail": fail} if fail else {})}
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 8\ninput: [{name: X, data_type: TYPE_FP32, dims: [2]}]\n"
        "output: [{name: Y, data_type: TYPE_FP32, dims: [2]}]\nparameters: {"
        + ", ".join(f"{k}: {{string_value: '{v}'}}" for k, v in params.items()) + "}\n")


def index(server) -> dict[str, tuple[str, str]]:
    models = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest()).models
    return {m.name: (m.state, m.reason) for m in models}


def on_demand(repo, *extra: str) -> RunningServer:
    return RunningServer(repo, "--model-control-mode", "on_demand", "--model-memory-budget", BUDGET, *extra)


@pytest.fixture
def twenty(tmp_path):
    repo = tmp_path / "repo"
    for i in range(20):
        matmul_model(repo / f"m{i:02d}", seed=i, parameters={"pinned": "true"} if i == 0 else None)
    matmul_model(repo / "huge", seed=99, parameters={"memory_bytes": "100MiB"})
    return repo


def test_twenty_models_answer_in_random_order_within_a_budget_of_five(twenty):
    server = on_demand(twenty)
    try:
        rows = index(server)
        assert all(rows[f"m{i:02d}"][0] == "UNAVAILABLE" and "not loaded" in rows[f"m{i:02d}"][1] for i in range(20))
        api = kserve.stub(server.channel)
        config = api.ModelConfig(pb.ModelConfigRequest(name="m07")).config  # answered cold, nothing loaded
        assert config.max_batch_size == 8 and server.metric("ferry_models_resident") == 0
        assert api.ModelReady(pb.ModelReadyRequest(name="m07")).ready  # cold but servable: its request loads it
        assert [i.name for i in api.ModelMetadata(pb.ModelMetadataRequest(name="m07")).inputs] == ["X"]
        order = [0] + [i for _ in range(3) for i in random.Random(7).sample(range(1, 20), 19)]
        budget = 50 * 2**20
        for i in order:
            y = kserve.infer(server.channel, f"m{i:02d}", {"X": X})["Y"]
            np.testing.assert_allclose(y, X @ weight(i), rtol=1e-4, atol=1e-3)
            used, resident = server.metric("ferry_model_memory_budget_used_bytes", place="host"), server.metric("ferry_models_resident")
            assert used <= budget and used == resident * MODEL_MIB * 2**20  # the server's accounting, from its metrics
            ready = [name for name, (state, _) in index(server).items() if state == "READY"]
            assert len(ready) == resident <= 5
            assert "m00" in ready  # pinned: never evicted, however long unused
        loads = sum(server.metric("ferry_model_loads", model=f"m{i:02d}") or 0 for i in range(20))
        evictions = sum(server.metric("ferry_model_evictions", model=f"m{i:02d}", reason="lru") or 0 for i in range(20))
        assert loads > 20 and evictions == loads - 5  # reloads after evictions; the five left are resident
        assert server.metric("ferry_model_loads", model="m00") == 1
        assert "evicted (lru" in server.output and "loaded on demand" in server.output  # a log line for each
        assert "memory: host 10.0 MiB (declared)" in index(server)["m00"][1]
    finally:
        server.stop()


def test_a_model_larger_than_the_budget_is_resource_exhausted(twenty):
    server = on_demand(twenty)
    try:
        with pytest.raises(grpc.RpcError) as info:
            kserve.infer(server.channel, "huge", {"X": X})
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "100.0 MiB" in info.value.details() and "50.0 MiB" in info.value.details()
        assert "even with every other model unloaded" in info.value.details()
        y = kserve.infer(server.channel, "m03", {"X": X})["Y"]  # the others still load and answer
        np.testing.assert_allclose(y, X @ weight(3), rtol=1e-4, atol=1e-3)
    finally:
        server.stop()


def test_a_burst_of_first_requests_loads_the_model_once(tmp_path):
    repo, gate = tmp_path / "repo", tmp_path / "gate"
    slow_load_model(repo / "slow", gate)
    server = on_demand(repo)
    x = np.array([[1.0, 2.0]], np.float32)
    try:
        with ThreadPoolExecutor(12) as pool:
            answers = [pool.submit(kserve.infer, server.channel, "slow", {"X": x}) for _ in range(12)]
            server.wait_for_metric("ferry_model_load_waiting_requests", 12, timeout_s=60, model="slow")  # all twelve wait
            gate.touch()
            for answer in answers:
                np.testing.assert_array_equal(answer.result()["Y"], x * 2)
        assert server.metric("ferry_model_loads", model="slow") == 1
    finally:
        gate.touch()
        server.stop()


def test_a_failed_load_fails_its_waiting_requests_with_its_error(tmp_path):
    repo, gate = tmp_path / "repo", tmp_path / "gate"
    slow_load_model(repo / "broken", gate, fail="weights are corrupt")
    server = on_demand(repo)
    x = np.array([[1.0, 2.0]], np.float32)
    try:
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(kserve.infer, server.channel, "broken", {"X": x}) for _ in range(3)]
            server.wait_for_metric("ferry_model_load_waiting_requests", 3, timeout_s=60, model="broken")
            gate.touch()
            for answer in answers:
                with pytest.raises(grpc.RpcError) as info:
                    answer.result()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "failed to load model 'broken'" in info.value.details() and "weights are corrupt" in info.value.details()
        assert server.metric("ferry_model_load_failures", model="broken") == 1
    finally:
        gate.touch()
        server.stop()


def test_a_cold_requests_deadline_applies_while_it_waits_for_the_load(tmp_path):
    repo, gate = tmp_path / "repo", tmp_path / "gate"
    slow_load_model(repo / "slow", gate)
    server = on_demand(repo)
    x = np.array([[1.0, 2.0]], np.float32)
    api = kserve.stub(server.channel)
    try:
        with pytest.raises(grpc.RpcError) as info:  # its own timeout (0.3 s) passes; the load is held by the gate
            api.ModelInfer(kserve.request("slow", {"X": x}, timeout=300_000), timeout=60)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "deadline passed while the model was loading" in info.value.details()
        gate.touch()  # the load it started goes on and serves the next request
        np.testing.assert_array_equal(kserve.infer(server.channel, "slow", {"X": x})["Y"], x * 2)
        assert server.metric("ferry_model_loads", model="slow") == 1
    finally:
        gate.touch()
        server.stop()


def test_the_measured_footprint_is_what_the_model_holds(tmp_path):
    """Without memory_bytes the load is measured, and the figure is the model's: three models holding a
    4 MiB weight each, loaded one after another, show about 4 MiB each. Not the runtime's one-off start
    (paid before the first measured load), nor what a load held only for a while (the model file read
    whole, the runtime's copies): before both were left out they measured 12-16 MiB each, so a budget
    held a third of the models it could. The bound leaves room for the heap arena of a thread the
    loader starts, which one load in a few pays (about one weight more)."""
    repo, width = tmp_path / "repo", 1024
    for seed in range(3):
        matmul_model(repo / f"m{seed}", seed, parameters={"memory_bytes": None}, width=width)
    server = RunningServer(repo, "--model-control-mode", "on_demand")
    try:
        x = np.linspace(-1, 1, width, dtype=np.float32).reshape(1, width)
        for seed in range(3):
            np.testing.assert_allclose(kserve.infer(server.channel, f"m{seed}", {"X": x})["Y"], x @ weight(seed, width),
                                       rtol=1e-4, atol=1e-3)
            measured = server.metric("ferry_model_memory_bytes", model=f"m{seed}", version="1", place="host")
            assert 3.8 * 2**20 <= measured <= 9.5 * 2**20, f"m{seed}: {measured / 2**20:.1f} MiB for a 4 MiB weight"
        assert "(measured)" in index(server)["m0"][1]
    finally:
        server.stop()


def test_flags_are_checked(tmp_path):
    import subprocess
    import sys

    for flags, words in ((["--model-memory-budget", "1GiB"], "needs --model-control-mode on_demand"),
                         (["--model-control-mode", "on_demand", "--model-memory-budget", "lots"], "is not a size"),
                         (["--model-control-mode", "on_demand", "--model-load-patience", "-1"], "0 or more")):
        done = subprocess.run([sys.executable, "-m", "server", "serve", "--model-repository", str(tmp_path), *flags],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and words in done.stderr




def test_an_ensemble_loads_its_cold_steps_on_its_first_request(tmp_path):
    repo = tmp_path / "repo"
    for i in (1, 2):
        matmul_model(repo / f"m{i:02d}", seed=i)
    steps = ", ".join(f'{{model_name: "{model}", input_map: {{key: "X", value: "{src}"}}, output_map: {{key: "Y", value: "{dst}"}}}}'
                      for model, src, dst in (("m01", "IN", "a"), ("m02", "a", "OUT")))
    (repo / "pair" / "1").mkdir(parents=True)
    (repo / "pair" / "config.pbtxt").write_text(f"""
platform: "ensemble"
max_batch_size: 8
input [{{name: "IN", data_type: TYPE_FP32, dims: [{WIDTH}]}}]
output [{{name: "OUT", data_type: TYPE_FP32, dims: [{WIDTH}]}}]
ensemble_scheduling {{ step [ {steps} ] }}
""")
    server = on_demand(repo)
    try:
        y = kserve.infer(server.channel, "pair", {"IN": X})["OUT"]
        np.testing.assert_allclose(y, X @ weight(1) @ weight(2), rtol=1e-3, atol=1e-2)
        assert server.metric("ferry_model_loads", model="m01") == 1 and server.metric("ferry_model_loads", model="m02") == 1
    finally:
        server.stop()


def test_http_requests_load_cold_models_and_statistics_show_the_footprint(twenty):
    import httpx

    server = on_demand(twenty)
    try:
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": list(X.shape), "data": X.ravel().tolist()}]}
        answer = httpx.post(f"{server.http_url}/v2/models/m05/infer", json=body, timeout=60)
        assert answer.status_code == 200
        y = np.array(answer.json()["outputs"][0]["data"], np.float32).reshape(X.shape)
        np.testing.assert_allclose(y, X @ weight(5), rtol=1e-4, atol=1e-3)
        stats = httpx.get(f"{server.http_url}/v2/models/m05/stats", timeout=10).json()["model_stats"][0]
        assert stats["memory_bytes"] == {"host": MODEL_MIB * 2**20} and stats["memory_declared"] is True
        too_big = httpx.post(f"{server.http_url}/v2/models/huge/infer", json=body, timeout=60)
        assert too_big.status_code == 429 and "100.0 MiB" in too_big.json()["error"]
    finally:
        server.stop()


def test_a_load_waits_for_a_colder_busy_model_rather_than_evict_a_hot_one(tmp_path):
    """Five slots: four hot models requested again and again, and a one-off model still serving its only
    request when a fifth model loads. Evicting the idle hot model would be the wrong trade: the load waits
    for the one-off to finish and evicts it."""
    repo, started, gate = tmp_path / "repo", tmp_path / "started", tmp_path / "gate"
    for i in range(1, 6):
        matmul_model(repo / f"m{i:02d}", seed=i)
    busy_model(repo / "oneoff", started, gate)
    server = on_demand(repo, "--model-load-patience", "120")
    try:
        for _ in range(2):
            for i in range(1, 5):
                kserve.infer(server.channel, f"m{i:02d}", {"X": X})
        with ThreadPoolExecutor(2) as pool:
            oneoff = pool.submit(kserve.infer, server.channel, "oneoff", {"X": np.ones((1, 2), np.float32)})
            wait_for(started.exists, 60, "the one-off model to start executing")
            fifth = pool.submit(kserve.infer, server.channel, "m05", {"X": X})
            server.wait_for_metric("ferry_model_load_waiting_requests", 1, timeout_s=60, model="m05")
            assert all(index(server)[f"m{i:02d}"][0] == "READY" for i in range(1, 5))  # nothing hot left for it
            gate.touch()
            np.testing.assert_array_equal(oneoff.result()["Y"], np.full((1, 2), 2, np.float32))
            np.testing.assert_allclose(fifth.result()["Y"], X @ weight(5), rtol=1e-4, atol=1e-3)
        assert server.metric("ferry_model_evictions", model="oneoff", reason="lru") == 1
        assert all(not server.metric("ferry_model_evictions", model=f"m{i:02d}", reason="lru") for i in range(1, 5))
        assert all(index(server)[f"m{i:02d}"][0] == "READY" for i in range(1, 6))
    finally:
        gate.touch()
        server.stop()


def test_a_load_waits_for_busy_models_to_free_the_room_instead_of_refusing(tmp_path):
    repo, started, gate = tmp_path / "repo", tmp_path / "started", tmp_path / "gate"
    matmul_model(repo / "m01", seed=1)
    busy_model(repo / "holder", started, gate)
    server = RunningServer(repo, "--model-control-mode", "on_demand", "--model-memory-budget", f"{MODEL_MIB}MiB",
                           "--model-load-patience", "120")
    try:
        with ThreadPoolExecutor(2) as pool:
            holder = pool.submit(kserve.infer, server.channel, "holder", {"X": np.ones((1, 2), np.float32)})
            wait_for(started.exists, 60, "the holder to start executing")
            other = pool.submit(kserve.infer, server.channel, "m01", {"X": X})  # no room while the holder works
            server.wait_for_metric("ferry_model_load_waiting_requests", 1, timeout_s=60, model="m01")
            gate.touch()
            np.testing.assert_array_equal(holder.result()["Y"], np.full((1, 2), 2, np.float32))
            np.testing.assert_allclose(other.result()["Y"], X @ weight(1), rtol=1e-4, atol=1e-3)
        assert server.metric("ferry_model_evictions", model="holder", reason="lru") == 1
    finally:
        gate.touch()
        server.stop()


def test_with_no_patience_busy_models_holding_the_room_refuse_the_load(tmp_path):
    repo, started, gate = tmp_path / "repo", tmp_path / "started", tmp_path / "gate"
    matmul_model(repo / "m01", seed=1)
    busy_model(repo / "holder", started, gate)
    server = RunningServer(repo, "--model-control-mode", "on_demand", "--model-memory-budget", f"{MODEL_MIB}MiB",
                           "--model-load-patience", "0")
    try:
        with ThreadPoolExecutor(1) as pool:
            holder = pool.submit(kserve.infer, server.channel, "holder", {"X": np.ones((1, 2), np.float32)})
            wait_for(started.exists, 60, "the holder to start executing")
            with pytest.raises(grpc.RpcError) as info:
                kserve.infer(server.channel, "m01", {"X": X})
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry when they are idle" in info.value.details()
            gate.touch()
            holder.result()
        np.testing.assert_allclose(kserve.infer(server.channel, "m01", {"X": X})["Y"], X @ weight(1), rtol=1e-4, atol=1e-3)
    finally:
        gate.touch()
        server.stop()

