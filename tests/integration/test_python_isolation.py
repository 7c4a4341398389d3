"""Each Python model instance runs in a process of its own: a model that crashes (os._exit, a segfault),
raises SystemExit or KeyboardInterrupt, or never returns costs only its own requests, while an ONNX
model and another Python model beside it keep answering; a dead process is replaced and counted."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, wait_for

CRASHY = '''
import ctypes, os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        mode = int(pb_utils.get_input_tensor_by_name(requests[0], "MODE").as_numpy()[0])
        if mode == 1:
            os._exit(3)
        if mode == 2:
            ctypes.string_at(0)  # a segfault
        if mode == 3:
            raise SystemExit(5)
        if mode == 4:
            raise KeyboardInterrupt
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", np.array([os.getpid()], np.int64))]) for _ in requests]
'''
CRASHY_CONFIG = """
backend: "python"
input [{ name: "MODE", data_type: TYPE_INT32, dims: [ 1 ] }]
output [{ name: "PID", data_type: TYPE_INT64, dims: [ 1 ] }]
"""
# Never returns; says it entered (with its pid) in the folder its config names.
HANG = '''
import os, time
import numpy as np


class Model:
    def initialize(self, args):
        self.folder = args["config"]["parameters"]["folder"]["string_value"]

    def execute(self, inputs):
        with open(os.path.join(self.folder, "entered"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(3600)
        return {"Y": inputs["X"]}
'''
HANG_CONFIG = """
backend: "python"
input [{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }]
output [{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }]
parameters: { key: "folder", value: { string_value: "%s" } }
"""
STEADY = '''
import numpy as np


class Model:
    def execute(self, inputs):
        return {"Y": inputs["X"] * 2}
'''
STEADY_CONFIG = HANG_CONFIG.split("parameters")[0]


def write(repo: Path, name: str, source: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    write(repo, "crashy", CRASHY, CRASHY_CONFIG)
    write(repo, "steady", STEADY, STEADY_CONFIG)
    return repo


def neighbours_answer(server) -> None:
    """The ONNX model and the other Python model, with their answers checked."""
    one = np.array([[1, 2, 3, 4]], np.float32)
    out = kserve.infer(server.channel, "simple", {"INPUT0": one, "INPUT1": one})
    assert out["OUTPUT0"].tolist() == [[2, 4, 6, 8]] and out["OUTPUT1"].tolist() == [[0, 0, 0, 0]]
    assert kserve.infer(server.channel, "steady", {"X": np.array([21], np.float32)})["Y"].tolist() == [42]


def crashy(server, mode: int):
    return kserve.infer(server.channel, "crashy", {"MODE": np.array([mode], np.int32)})["PID"][0]


def crashy_error(server, mode: int) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        crashy(server, mode)
    return info.value


def test_a_crashing_model_fails_its_request_alone_and_is_restarted(repo, start_server):
    server = start_server(repo)
    first = crashy(server, 0)
    assert first != server.proc.pid
    for mode, cause in ((1, "exited with exit code 3"), (2, "exited with signal 11 (SIGSEGV)")):
        neighbours_answer(server)
        err = crashy_error(server, mode)
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert err.details() == f"model process for 'crashy' {cause}"
        neighbours_answer(server)
        again = crashy(server, 0)  # a new process, initialized again
        assert again not in (first, server.proc.pid)
        first = again
    assert server.metric("ferry_model_process_restarts_total", model="crashy", version="1") == 2.0
    assert server.proc.poll() is None


def test_system_exit_and_keyboard_interrupt_fail_at_once_and_the_process_keeps_serving(repo, start_server):
    server = start_server(repo)
    pid = crashy(server, 0)
    for mode, message in ((3, "model code raised SystemExit(5)"), (4, "model code raised KeyboardInterrupt")):
        err = crashy_error(server, mode)
        assert err.code() == grpc.StatusCode.INTERNAL
        assert err.details() == f"Failed to process the request(s) for model instance 'crashy_0_0', message: {message}"
        neighbours_answer(server)
        assert crashy(server, 0) == pid  # the same process
    assert (server.metric("ferry_model_process_restarts_total", model="crashy", version="1") or 0.0) == 0.0


def hang_repo(repo: Path, folder: Path) -> None:
    write(repo, "hang", HANG, HANG_CONFIG % folder)


def start_hanging_call(server, timeout_s: float | None):
    """A call to the hanging model on a thread; returns (thread, where its error goes)."""
    errors = []

    def call():
        try:
            kserve.stub(server.channel).ModelInfer(kserve.request("hang", {"X": np.array([1], np.float32)}),
                                                   timeout=timeout_s)
        except grpc.RpcError as exc:
            errors.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, errors


def test_a_hung_model_is_unloaded_and_its_process_ended(repo, tmp_path, start_server):
    folder = tmp_path / "signals"
    folder.mkdir()
    hang_repo(repo, folder)
    server = start_server(repo, "--model-control-mode", "explicit", "--load-model", "*", "--drain-grace-seconds", "1")
    thread, errors = start_hanging_call(server, timeout_s=3)
    wait_for(lambda: (folder / "entered").exists() and (folder / "entered").read_text(), 60, "the model to start")
    pid = int((folder / "entered").read_text())
    thread.join(60)
    assert errors and errors[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED  # the caller's deadline answered it
    kserve.stub(server.channel).RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="hang"), timeout=60)
    wait_for(lambda: not _alive(pid), 30, "the hung model's process to end")
    neighbours_answer(server)


def test_sigterm_ends_the_server_within_its_grace_whatever_a_model_does(repo, tmp_path):
    folder = tmp_path / "signals"
    folder.mkdir()
    hang_repo(repo, folder)
    server = RunningServer(repo, "--drain-grace-seconds", "2")
    try:
        start_hanging_call(server, timeout_s=None)
        wait_for(lambda: (folder / "entered").exists() and (folder / "entered").read_text(), 60, "the model to start")
        pid = int((folder / "entered").read_text())
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)  # a bound for a slow machine, not a timing assertion: it used to never exit
        assert code == 0, server.output[-2000:]
        wait_for(lambda: not _alive(pid), 30, "the hung model's process to end")
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _autogroup_nice(pid: int) -> int | None:
    """The nice value of the process's autogroup (Linux shares the CPU between sessions by it first), or
    None where the kernel has no autogroups or the process is in the root one (an empty file, weighing as
    nice 0: a server started from init's session, as CI's is)."""
    try:
        text = Path(f"/proc/{pid}/autogroup").read_text()
    except OSError:
        return None
    return int(text.split("nice")[1]) if "nice" in text else None


def _yields_by(pid: int, server, by: int) -> bool:
    """Whether the process's autogroup sits `by` nice levels below the server's, wherever there are
    autogroups; or the server said it could not set it (some sandboxes refuse the write or keep nothing)."""
    theirs = _autogroup_nice(pid)
    return (theirs is None or theirs == min(19, (_autogroup_nice(server.proc.pid) or 0) + by)
            or "autogroup priority could not be lowered" in server.output)


def _not_lowered(pid: int, server) -> bool:
    """Whether the process's autogroup (where it has one) is not below the server's: a new session's
    starts at nice 0."""
    theirs = _autogroup_nice(pid)
    return theirs is None or theirs <= max(0, _autogroup_nice(server.proc.pid) or 0)


def test_a_model_process_runs_at_the_priority_its_config_asks_and_keeps_it_when_restarted(tmp_path, start_server):
    repo = tmp_path / "repo"
    write(repo, "crashy", CRASHY, CRASHY_CONFIG + 'parameters: { key: "FERRY_PROCESS_NICE", value: { string_value: "7" } }\n')
    write(repo, "wrong", STEADY, STEADY_CONFIG + 'parameters: { key: "FERRY_PROCESS_NICE", value: { string_value: "-5" } }\n')
    write(repo, "steady", STEADY, STEADY_CONFIG)
    server = start_server(repo)
    base = os.getpriority(os.PRIO_PROCESS, server.proc.pid)
    pid = int(crashy(server, 0))
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, base + 7)
    assert _yields_by(pid, server, 7)  # its session yields too
    crashy_error(server, 1)  # the process exits; the next call starts another
    pid = int(crashy(server, 0))
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, base + 7)
    assert _yields_by(pid, server, 7)
    assert kserve.infer(server.channel, "steady", {"X": np.array([21], np.float32)})["Y"].tolist() == [42]
    index = kserve.stub(server.channel).RepositoryIndex(pb.RepositoryIndexRequest())
    wrong = next(m for m in index.models if m.name == "wrong")
    assert wrong.state == "UNAVAILABLE" and "FERRY_PROCESS_NICE is '-5'" in wrong.reason


# Spends 60 ms of CPU a call: CPU time, not wall time, so it is as heavy on a slow or busy machine.
HEAVY = '''
import os, time
import numpy as np


class Model:
    def execute(self, inputs):
        end, spins = time.process_time() + 0.06, 0
        while time.process_time() < end:
            spins += 1
        return {"PID": np.array([os.getpid()], np.int64)}
'''
HEAVY_CONFIG = """
backend: "python"
input [{ name: "X", data_type: TYPE_FP32, dims: [ 1 ] }]
output [{ name: "PID", data_type: TYPE_INT64, dims: [ 1 ] }]
"""


def _nice_of(thread: int) -> int | None:
    """A thread's nice value; None for one that ended while we looked."""
    try:
        return os.getpriority(os.PRIO_PROCESS, thread)
    except ProcessLookupError:
        return None


def _threads_nice(pid: int) -> set[int]:
    """The nice values of the process's living threads (Linux keeps one per thread)."""
    return {_nice_of(int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir()} - {None}


def test_a_model_that_keeps_a_core_busy_is_lowered_by_default_and_a_light_or_pinned_one_is_not(tmp_path, start_server):
    repo = tmp_path / "repo"
    write(repo, "heavy", HEAVY, HEAVY_CONFIG)
    write(repo, "pinned", HEAVY, HEAVY_CONFIG + 'parameters: { key: "FERRY_PROCESS_NICE", value: { string_value: "0" } }\n')
    write(repo, "crashy", CRASHY, CRASHY_CONFIG)  # light: answers its pid at once
    server = start_server(repo)
    base = os.getpriority(os.PRIO_PROCESS, server.proc.pid)

    def heavy(name: str) -> int:
        return int(kserve.infer(server.channel, name, {"X": np.array([1], np.float32)})["PID"][0])

    pid, light = heavy("heavy"), int(crashy(server, 0))
    assert os.getpriority(os.PRIO_PROCESS, pid) == base  # starts at the server's priority
    calls = 0

    def lowered() -> bool:
        nonlocal calls
        for _ in range(5):  # busy most of each second (300 ms of CPU per light call between)
            assert heavy("heavy") == pid
            calls += 1
        assert crashy(server, 0) == light
        return os.getpriority(os.PRIO_PROCESS, pid) == min(19, base + 10)

    wait_for(lowered, 120, "the busy model's process to be lowered")
    wait_for(lambda: _threads_nice(pid) == {min(19, base + 10)}, 30, "every thread of it to be lowered")
    wait_for(lambda: _yields_by(pid, server, 10), 30, "its session to yield too, where the kernel has autogroups")
    assert os.getpriority(os.PRIO_PROCESS, light) == base and _not_lowered(light, server)
    assert "its CPU priority is lowered by 10" in server.output

    pinned = heavy("pinned")
    for _ in range(calls + 10):  # as busy, longer: FERRY_PROCESS_NICE 0 keeps it at the server's priority
        assert heavy("pinned") == pinned
    assert _threads_nice(pinned) == {base} and _not_lowered(pinned, server)

    os.kill(pid, signal.SIGKILL)  # a new process is judged afresh: it starts at the server's priority
    wait_for(lambda: not _alive(pid), 30, "the heavy model's process to end")
    try:
        again = heavy("heavy")
    except grpc.RpcError:  # the call reached the dead process before the server saw it die
        again = heavy("heavy")
    assert again != pid and os.getpriority(os.PRIO_PROCESS, again) == base
