"""`--frontend-processes 2` behaves as one process: answers, errors, statistics, deadlines, cancellation,
drain, tokens, shared memory and tritonclient, checked against a one-process server on the same repository.

A third server runs with a 4 KiB arena, so most tensors travel inline in the link's frames: the fallback
path answers the same. Work is held by the gated python model, opened by the test, never by a clock.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

from grpc_health.v1 import health_pb2

from protos import grpc_service_pb2 as pb
from server.tensors import datatypes
from tests import builders, kserve
from tests.conftest import RunningServer, link_shipped_models, wait_for
from tests.integration.test_drain import _code, health_status

FRONTENDS = ("--frontend-processes", "2")
HOLD = {"X": np.array([[-1, -1]], np.float32)}  # negative: the gated model waits for the gate file
A = np.arange(8, dtype=np.float32).reshape(2, 4)
B = np.full((2, 4), 2, np.float32)


def _repo(root: Path) -> tuple[Path, Path]:
    repo = root / "repo"
    builders.script_models(repo)
    builders.identity_all_types(repo / "types" / "1" / "model.onnx")
    builders.identity_all_types(repo / "typed" / "1" / "model.onnx", skip=("FP16",))  # FP16 has no typed field
    gate = root / "gate"
    builders.gated_model(repo, "gated", gate=gate, max_batch_size=1)
    link_shipped_models(repo, "tiny_llama")
    return repo, gate


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    repo, gate = _repo(tmp_path_factory.mktemp("frontends"))
    started = []
    try:
        for extra in ((), FRONTENDS, (*FRONTENDS, "--frontend-arena-bytes", "4096")):
            # tritonclient_calls registers regions and changes log settings: both off by default
            started.append(RunningServer(repo, *extra, "--allow-shared-memory", "--allow-log-settings"))
        for server in started:
            server.gate = gate
        yield started
    finally:
        for server in started:
            assert server.stop() == 0, server.output
            assert "still held" not in server.output, "arena blocks were never handed back"


def _all_types(rows: int, cols: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    arrays = {}
    for api in builders.ONNX_TYPES:
        if api == "BYTES":
            arrays["IN_BYTES"] = np.array([[f"r{i}c{j}".encode() * (j + 1) for j in range(cols)] for i in range(rows)],
                                          dtype=object)
        elif api == "BOOL":
            arrays["IN_BOOL"] = rng.integers(0, 2, (rows, cols)).astype(bool)
        else:
            dtype = np.dtype(datatypes.BY_API[api].numpy)
            arrays[f"IN_{api}"] = (rng.standard_normal((rows, cols)) * 100).astype(dtype)
    return arrays


def _requests() -> list[pb.ModelInferRequest]:
    simple = {"INPUT0": A, "INPUT1": B}
    typed = {k: v for k, v in _all_types(2, 3).items() if k != "IN_FP16"}
    classified = kserve.request("types", _all_types(2, 3), outputs=["OUT_FP32", "OUT_BYTES"])
    classified.outputs[0].parameters["classification"].int64_param = 2
    return [
        kserve.request("simple", simple, request_id="r-1"),
        kserve.request("simple", simple, typed=True, version="1"),
        kserve.request("simple", simple, outputs=["OUTPUT1"], priority=1),
        kserve.request("types", _all_types(2, 3)),
        kserve.request("typed", typed, typed=True),
        kserve.request("types", _all_types(4, 1024)),  # 32 KiB of FP64: in the default arena, inline in the small one
        kserve.request("types", _all_types(1, 0)),  # zero bytes
        kserve.request("echo", {"TEXT": np.array([[b"hello", "w\u00f6rld".encode()]], dtype=object)}),
        classified,
    ]


def test_same_answers_as_one_process(servers):
    for request in _requests():
        answers = [kserve.stub(s.channel).ModelInfer(request, timeout=60) for s in servers]
        assert answers[0].outputs, request.model_name
        assert answers[1] == answers[0] and answers[2] == answers[0], request.model_name


def test_concurrent_calls_each_get_their_own_answer(servers):
    """Many calls in flight at once through the arena (and inline in the small one): no answer is another's,
    no block is reused while its bytes are still being read."""
    base = _all_types(4, 2)  # the other inputs small: only IN_FP64 (32 KiB) is large
    for server in servers[1:]:
        stub = kserve.stub(server.channel)
        sent = [np.full((4, 1024), i, np.float64) + np.arange(1024) for i in range(120)]
        calls = [stub.ModelInfer.future(kserve.request("types", {**base, "IN_FP64": x}, outputs=["OUT_FP64"]), timeout=120)
                 for x in sent]
        for x, call in zip(sent, calls):
            assert np.array_equal(kserve.outputs(call.result())["OUT_FP64"], x)


def _bad_requests() -> list:
    simple = {"INPUT0": A, "INPUT1": B}
    bad = []
    bad.append(kserve.request("nope", simple))
    bad.append(kserve.request("simple", simple, version="7"))
    bad.append(kserve.request("simple", simple, version="x"))
    bad.append(kserve.request("simple", {"INPUT0": A[:, :2], "INPUT1": B}))  # wrong shape
    bad.append(kserve.request("simple", {"INPUT0": A.astype(np.float64), "INPUT1": B}))  # wrong datatype
    bad.append(kserve.request("simple", {"INPUT0": A}))  # missing input
    bad.append(kserve.request("simple", {**simple, "EXTRA": A}))  # unknown input
    bad.append(kserve.request("simple", simple, outputs=["NOPE"]))  # unknown output
    bad.append(kserve.request("simple", simple, triton_secret=1))  # reserved parameter
    bad.append(kserve.request("simple", simple, priority=-1))
    bad.append(kserve.request("tiny_llama", simple))  # a generation model on ModelInfer
    bad.append(kserve.request("broken", simple))  # failed to load
    unknown_type = kserve.request("simple", simple)
    unknown_type.inputs[0].datatype = "FP99"
    bad.append(unknown_type)
    short = kserve.request("simple", simple)
    short.raw_input_contents[0] = short.raw_input_contents[0][:-4]
    bad.append(short)
    mixed = kserve.request("simple", simple)
    mixed.inputs[0].contents.fp32_contents.extend([1.0] * 8)
    bad.append(mixed)
    unknown_and_bad = kserve.request("nope", simple)  # the model lookup comes first, as in one process
    unknown_and_bad.inputs[0].datatype = "FP99"
    bad.append(unknown_and_bad)
    bytes_classified = kserve.request("echo", {"TEXT": np.array([[b"a", b"b"]], dtype=object)}, outputs=["TEXT_OUT"])
    bytes_classified.outputs[0].parameters["classification"].int64_param = 1
    bad.append(bytes_classified)
    reserved_output = kserve.request("simple", simple, outputs=["OUTPUT0"])
    reserved_output.outputs[0].parameters["classification"].int64_param = 1
    reserved_output.outputs[0].parameters["triton_x"].int64_param = 1
    bad.append(reserved_output)
    bad.append(b"\xff\xff\xff")  # not a protobuf message
    return bad


def _error(channel, request) -> tuple[grpc.StatusCode, str]:
    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    body = request if isinstance(request, bytes) else request.SerializeToString()
    try:
        call(body, timeout=60)
    except grpc.RpcError as err:
        return err.code(), err.details()
    raise AssertionError(f"{request!r:.200} was answered")


def test_same_errors_as_one_process(servers):
    for request in _bad_requests():
        errors = [_error(s.channel, request) for s in servers]
        assert errors[0][0] != grpc.StatusCode.INTERNAL, errors[0]
        assert errors[1] == errors[0] and errors[2] == errors[0]


def test_unknown_methods_answer_as_one_process(servers):
    # Fresh connections, a dozen per method: relaying these once raced into INTERNAL on some of them.
    for method in ("/inference.GRPCInferenceService/Nope", "/no.Such/Service"):
        errors = set()
        for server in servers[:2]:
            for _ in range(12):
                with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
                    channel.unary_unary(method)(b"", timeout=30)
                errors.add((err.value.code(), err.value.details()))
        assert len(errors) == 1 and next(iter(errors))[0] == grpc.StatusCode.UNIMPLEMENTED, errors


def test_statistics_count_every_request_sent_through_any_front_end(servers):
    server = servers[1]
    stub = kserve.stub(server.channel)

    def counts():
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name="simple"), timeout=30).model_stats[0]
        return stats.inference_stats.success.count, stats.inference_count

    before = counts()
    sent = 0
    for _ in range(6):  # fresh connections: the kernel spreads them over both front ends
        with grpc.insecure_channel(server.address) as channel:
            for _ in range(5):
                kserve.infer(channel, "simple", {"INPUT0": A, "INPUT1": B})
                sent += 1
    after = counts()
    assert after[0] - before[0] == sent
    assert after[1] - before[1] == 2 * sent  # two rows each
    assert server.metric("nv_inference_request_success", model="simple") == after[0]


def test_tritonclient_sees_the_same_server(servers):
    script = Path(__file__).with_name("tritonclient_calls.py")
    found = []
    for server in servers[:2]:
        done = subprocess.run([sys.executable, str(script), server.address], capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr
        found.append(_without_timings(json.loads(done.stdout)))
    assert found[0]["sum_ok"] and found[0]["bytes_ok"] and found[0]["stream"]
    assert found[1] == found[0]


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in ("ns", "last_inference", "stats")}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


def test_system_shared_memory_regions_reach_the_engine(servers):
    stub = kserve.stub(servers[1].channel)
    key = f"/ferry_frontends_{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / key.lstrip("/")
    path.write_bytes(bytes(256))
    try:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 256) as m:
            m[0:32], m[32:64] = A.tobytes(), B.tobytes()
            stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(name="io", key=key, byte_size=256), timeout=30)
            request = pb.ModelInferRequest(model_name="simple")
            for i, name in enumerate(("INPUT0", "INPUT1")):
                tensor = request.inputs.add(name=name, datatype="FP32", shape=[2, 4])
                tensor.parameters["shared_memory_region"].string_param = "io"
                tensor.parameters["shared_memory_byte_size"].int64_param = 32
                tensor.parameters["shared_memory_offset"].int64_param = 32 * i
            out = request.outputs.add(name="OUTPUT0")
            out.parameters["shared_memory_region"].string_param = "io"
            out.parameters["shared_memory_byte_size"].int64_param = 32
            out.parameters["shared_memory_offset"].int64_param = 128
            stub.ModelInfer(request, timeout=60)
            assert np.array_equal(np.frombuffer(m[128:160], np.float32).reshape(2, 4), A + B)
            status = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=30)
            assert list(status.regions) == ["io"]
            stub.SystemSharedMemoryUnregister(pb.SystemSharedMemoryUnregisterRequest(name="io"), timeout=30)
    finally:
        path.unlink()


def test_deadline_and_cancellation_reach_the_engine(servers):
    server = servers[1]
    stub = kserve.stub(server.channel)
    gate, running = server.gate, Path(str(server.gate) + ".running")
    running.unlink(missing_ok=True)
    executions = _executions(stub)
    held = stub.ModelInfer.future(kserve.request("gated", HOLD), timeout=120)
    try:
        wait_for(running.exists, what="the held execution to start")
        cancelled = stub.ModelInfer.future(kserve.request("gated", {"X": np.ones((1, 2), np.float32)}), timeout=120)
        server.wait_for_metric("nv_inference_pending_request_count", 1, timeout_s=60, model="gated")
        cancelled.cancel()
        server.wait_for_metric("nv_inference_request_failure", 1, timeout_s=60, model="gated", reason="CANCELED")
        server.wait_for_metric("nv_inference_pending_request_count", 0, timeout_s=60, model="gated")

        # The request's own timeout: the engine's queue expires it while the execution is held.
        timed = kserve.request("gated", {"X": np.ones((1, 2), np.float32)}, timeout=100_000)
        code, details = _error(server.channel, timed)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline passed" in details, details
        # The call's gRPC deadline: the remaining time travels with the call.
        late = stub.ModelInfer.future(kserve.request("gated", {"X": np.ones((1, 2), np.float32)}), timeout=1.0)
        assert _code(late) == grpc.StatusCode.DEADLINE_EXCEEDED
        server.wait_for_metric("nv_inference_pending_request_count", 0, timeout_s=60, model="gated")
    finally:
        gate.touch()
    try:
        held.result()
        assert _executions(stub) == executions + 1  # only the held request ever ran
    finally:
        gate.unlink()


def _executions(stub) -> int:
    return stub.ModelStatistics(pb.ModelStatisticsRequest(name="gated"), timeout=30).model_stats[0].execution_count


QUEUED = 12


def test_drain_answers_admitted_requests_and_refuses_new_ones(tmp_path):
    gate = tmp_path / "gate"
    builders.gated_model(tmp_path / "repo", "gated", gate=gate, max_batch_size=1)
    server = RunningServer(tmp_path / "repo", *FRONTENDS, "--drain-grace-seconds", "0.5")
    try:
        stub = kserve.stub(server.channel)
        calls = [stub.ModelInfer.future(kserve.request("gated", HOLD), timeout=120) for _ in range(QUEUED)]
        wait_for(lambda: (tmp_path / "gate.running").exists(), what="the first execution to start")
        server.wait_for_metric("nv_inference_pending_request_count", QUEUED - 1, timeout_s=60, model="gated")

        server.proc.send_signal(signal.SIGTERM)
        codes = [_code(call) for call in calls]
        assert grpc.StatusCode.CANCELLED not in codes and grpc.StatusCode.DEADLINE_EXCEEDED not in codes, codes
        assert codes.count(grpc.StatusCode.UNAVAILABLE) == QUEUED  # the gate is shut: none could finish

        # The held execution keeps the engine, and so the front ends, serving: probes answer, the rest is refused.
        assert health_status(server.channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert not stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        for call in (lambda: stub.ModelInfer(kserve.request("gated", {"X": np.ones((1, 2), np.float32)}), timeout=10),
                     lambda: stub.ModelMetadata(pb.ModelMetadataRequest(name="gated"), timeout=10)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    finally:
        gate.touch()
    assert server.stop() == 0, server.output
    assert "ferry: stopped" in server.output


def _frontend_pids(server: RunningServer) -> dict[int, int]:
    found = re.findall(r"ferry: front end (\d+) of \d+ serving \(pid (\d+)\)", server.output)
    return {int(index): int(pid) for index, pid in found}  # the latest pid of each


def test_tokens_apply_and_a_killed_front_end_is_restarted(tmp_path):
    repo = tmp_path / "repo"
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    server = RunningServer(repo, *FRONTENDS, "--auth-token-file", str(tokens))
    try:
        request = kserve.request("simple", {"INPUT0": A, "INPUT1": B})
        stub = kserve.stub(server.channel)
        auth = (("authorization", "Bearer s3cret"),)
        with pytest.raises(grpc.RpcError) as err:
            stub.ModelInfer(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="simple"), metadata=auth, timeout=30)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stub.ModelInfer(request, metadata=auth, timeout=30).outputs

        victim = _frontend_pids(server)[1]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _frontend_pids(server)[1] != victim, what="the killed front end to be replaced")
        assert f"front end process 1 (pid {victim}) exited with code -9; restarting it" in server.output
        for _ in range(8):  # fresh connections land on either front end, the new one included
            with grpc.insecure_channel(server.address) as channel:
                assert kserve.stub(channel).ModelInfer(request, metadata=auth, timeout=30).outputs
    finally:
        code = server.stop()
    assert code == 0, server.output


def test_front_end_count_is_checked():
    done = subprocess.run([sys.executable, "-m", "server", "serve", "--model-repository", ".", "--frontend-processes", "0"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2 and "--frontend-processes must be 1 or more" in done.stderr


def test_killed_engine_takes_its_front_ends_with_it(tmp_path):
    repo = tmp_path / "repo"
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    server = RunningServer(repo, *FRONTENDS)
    pids = list(_frontend_pids(server).values())
    server.proc.kill()
    server.proc.wait()
    wait_for(lambda: not any(_alive(pid) for pid in pids), 60, "the front ends to exit after their engine")
    server.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has exited


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command makes the certificate")
def test_front_ends_serve_tls_with_the_same_flags(tmp_path):
    cert, key, name = tmp_path / "cert.pem", tmp_path / "key.pem", "ferry.test"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", f"/CN={name}",
                    "-addext", f"subjectAltName=DNS:{name}"], check=True, capture_output=True)
    repo = tmp_path / "repo"
    builders.add_sub(repo / "simple" / "1" / "model.onnx")
    server = RunningServer(repo, *FRONTENDS, "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(server.address, credentials, options=[("grpc.ssl_target_name_override", name)]) as channel:
            stub = kserve.stub(channel)
            assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready  # relayed
            assert stub.ModelInfer(kserve.request("simple", {"INPUT0": A, "INPUT1": B}), timeout=30).outputs  # decoded here
        with pytest.raises(grpc.RpcError) as err:  # plaintext is refused by every front end
            kserve.stub(server.channel).ServerReady(pb.ServerReadyRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        assert server.stop() == 0, server.output
