"""Trains: requests of a Python model that does not batch (max_batch_size 0, Triton's face), queued while
its process runs one, go to the process together in one frame, and each still runs by an execute of its
own, fails alone and is counted as its own execution. A process that dies in a train fails only the
request that was running; the ones behind it run on the next process."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import numpy as np
import pytest

from tests import kserve
from tests.conftest import wait_for

MODEL = '''
import json, os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.folder = json.loads(args["model_config"])["parameters"]["folder"]["string_value"]

    def execute(self, requests):
        with open(os.path.join(self.folder, "sizes"), "a") as f:
            f.write(f"{len(requests)}\\n")
        x = pb_utils.get_input_tensor_by_name(requests[0], "X").as_numpy()
        if x[0] == -1:  # the holder: says it entered, then blocks on the gate (a FIFO) until the test writes it
            open(os.path.join(self.folder, "entered"), "w").close()
            with open(os.path.join(self.folder, "gate")) as gate:
                gate.read()
        if x[0] == 13:
            raise pb_utils.TritonModelException("thirteen is refused")
        if x[0] == 66:
            os._exit(9)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2),
                                            pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))])]
'''
CONFIG = """
backend: "python"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }]
output [{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }, { name: "PID", data_type: TYPE_INT64, dims: [ 1 ] }]
parameters: { key: "folder", value: { string_value: "%s" } }
parameters: { key: "FERRY_TRAIN_US", value: { string_value: "%s" } }
"""


def serve(tmp_path: Path, start_server, train_us: str):
    folder = tmp_path / "gates"
    folder.mkdir()
    os.mkfifo(folder / "gate")
    (tmp_path / "repo" / "m" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "m" / "1" / "model.py").write_text(MODEL)
    (tmp_path / "repo" / "m" / "config.pbtxt").write_text(CONFIG % (folder, train_us))
    return start_server(tmp_path / "repo"), folder


def infer(server, x: float):
    return kserve.stub(server.channel).ModelInfer.future(kserve.request("m", {"X": np.array([x], np.float32)}), timeout=120)


def queue_behind_holder(server, folder: Path, values: list[float]) -> tuple:
    """Eight requests answered one by one (the process's executes are measured), then a holder the model
    keeps, then `values` sent while it is held: all of them queued before the gate opens."""
    for x in range(1, 9):
        assert kserve.infer(server.channel, "m", {"X": np.array([x], np.float32)})["Y"].tolist() == [2 * x]
    holder = infer(server, -1)
    wait_for(lambda: (folder / "entered").exists(), what="the holder's execute to begin")
    queued = [infer(server, x) for x in values]
    wait_for(lambda: server.metric("nv_inference_pending_request_count", model="m") == len(values),
             what=f"{len(values)} requests queued behind the holder")
    with open(folder / "gate", "w") as gate:  # the holder has it open for reading: this returns at once
        gate.write("open")
    return holder, queued


def executes_saw(folder: Path) -> list[int]:
    return [int(line) for line in (folder / "sizes").read_text().split()]


def test_queued_requests_go_as_one_train_and_each_runs_and_fails_alone(tmp_path, start_server):
    server, folder = serve(tmp_path, start_server, "10000000")  # a budget no execute here fills: trains up to 16
    values = [20, 21, 13, 22, 23, 24]
    holder, queued = queue_behind_holder(server, folder, values)
    assert kserve.outputs(holder.result())["Y"].tolist() == [-2]
    for x, call in zip(values, queued):
        if x == 13:
            with pytest.raises(grpc.RpcError) as info:
                call.result()
            assert "thirteen is refused" in info.value.details()
        else:
            assert kserve.outputs(call.result())["Y"].tolist() == [2 * x]
    assert server.metric("ferry_train_executions", model="m") == len(values)  # the six queued left together
    assert server.metric("ferry_trains", model="m") == 1
    assert executes_saw(folder) == [1] * (8 + 1 + len(values))  # yet every execute got one request
    stats = kserve.stub(server.channel).ModelStatistics(kserve.pb.ModelStatisticsRequest(name="m")).model_stats[0]
    assert stats.execution_count == stats.inference_count == 8 + 1 + len(values)


def test_a_process_that_dies_in_a_train_fails_only_the_running_request(tmp_path, start_server):
    server, folder = serve(tmp_path, start_server, "10000000")
    values = [30, 66, 31, 32]
    holder, queued = queue_behind_holder(server, folder, values)
    first = kserve.outputs(holder.result())["PID"][0]
    answers = {}
    for x, call in zip(values, queued):
        if x == 66:
            with pytest.raises(grpc.RpcError) as info:
                call.result()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "exit code 9" in info.value.details()
        else:
            answers[x] = kserve.outputs(call.result())
            assert answers[x]["Y"].tolist() == [2 * x]
    assert answers[30]["PID"][0] == first  # ran before the crash, in the train's process
    assert answers[31]["PID"][0] == answers[32]["PID"][0] != first  # never began there: ran on the next process
    assert server.metric("ferry_train_executions", model="m") == len(values)


def test_no_trains_where_the_config_turns_them_off(tmp_path, start_server):
    server, folder = serve(tmp_path, start_server, "0")
    values = [40, 41, 42]
    holder, queued = queue_behind_holder(server, folder, values)
    holder.result()
    assert [kserve.outputs(call.result())["Y"].tolist() for call in queued] == [[80], [82], [84]]
    assert server.metric("ferry_train_executions", model="m") == server.metric("ferry_trains", model="m") == 0
    assert executes_saw(folder) == [1] * (8 + 1 + len(values))


def test_a_train_setting_that_is_not_whole_microseconds_is_refused_at_load(tmp_path, start_server):
    """FERRY_TRAIN_US and FERRY_TRAIN_HOLD_US take whole microseconds >= 0; anything else fails the load
    with the parameter named, rather than serving with a setting the user did not mean."""
    for name, parameter, value in (("budget", "FERRY_TRAIN_US", "soon"), ("hold", "FERRY_TRAIN_HOLD_US", "-5")):
        (tmp_path / "repo" / name / "1").mkdir(parents=True)
        (tmp_path / "repo" / name / "1" / "model.py").write_text(MODEL)
        config = CONFIG.replace("FERRY_TRAIN_US", parameter) % (tmp_path, value)
        (tmp_path / "repo" / name / "config.pbtxt").write_text(config)
    server = start_server(tmp_path / "repo")
    index = {m.name: m for m in kserve.stub(server.channel).RepositoryIndex(kserve.pb.RepositoryIndexRequest()).models}
    for name, parameter, value in (("budget", "FERRY_TRAIN_US", "soon"), ("hold", "FERRY_TRAIN_HOLD_US", "-5")):
        assert index[name].state == "UNAVAILABLE"
        assert parameter in index[name].reason and repr(value) in index[name].reason, index[name].reason
