"""Ensembles with decoupled steps, as Triton serves them (its QA io suite's `ensemble_io`, decoupled trial):
each response of a decoupled step runs the rest of the pipeline, so a chain of two steps of two responses
each answers four times on ModelStreamInfer; ModelInfer refuses such an ensemble, as it refuses any
decoupled model; a failing fork fails its request alone.

The step models are Triton Python models (pb_utils response senders); the calls go over Ferry's own
KServe stubs.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import kserve
from tests.conftest import RunningServer

FAN_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            sender = request.get_response_sender()
            for i in range({count}):  # response i: X + {step} * i
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x + {step} * i).astype(np.float32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

TWICE_MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                raise pb_utils.TritonModelException("negative input")
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", (x * 2).astype(np.float32))]))
        return out
'''

IO = """
input [{name: "X", data_type: TYPE_FP32, dims: [-1]}]
output [{name: "Y", data_type: TYPE_FP32, dims: [-1]}]
"""


def _config(decoupled: bool) -> str:
    policy = "model_transaction_policy { decoupled: true }\n" if decoupled else ""
    return f'backend: "python"\nmax_batch_size: 0\n{policy}{IO}'


def _write(repo, name: str, source: str, decoupled: bool) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(source)
    (repo / name / "config.pbtxt").write_text(_config(decoupled))


def _ensemble(repo, name: str, models: list[str]) -> None:
    tensors = ["X"] + [f"t{i}" for i in range(1, len(models))] + ["Y"]
    steps = ", ".join(f'{{model_name: "{m}", model_version: -1, input_map {{key: "X", value: "{tensors[i]}"}}, '
                      f'output_map {{key: "Y", value: "{tensors[i + 1]}"}}}}' for i, m in enumerate(models))
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: 0\n{IO}\nensemble_scheduling {{ step [ {steps} ] }}\n')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    _write(repo, "fan_two", FAN_MODEL.format(count=2, step=10), decoupled=True)
    _write(repo, "fan_three", FAN_MODEL.format(count=3, step=100), decoupled=True)
    _write(repo, "fan_down", FAN_MODEL.format(count=2, step=-10), decoupled=True)  # X, then X - 10
    _write(repo, "fan_none", FAN_MODEL.format(count=0, step=1), decoupled=True)
    _write(repo, "twice", TWICE_MODEL, decoupled=False)
    _ensemble(repo, "fan_fan_twice", ["fan_two", "fan_three", "twice"])
    _ensemble(repo, "twice_fan", ["twice", "fan_two"])
    _ensemble(repo, "fan_down_twice", ["fan_down", "twice"])
    _ensemble(repo, "fan_none_twice", ["fan_none", "twice"])
    _ensemble(repo, "plain", ["twice", "twice"])
    running = RunningServer(repo)
    yield running
    running.stop()


def _stream(server, model: str, x: np.ndarray, count: int = 1) -> list[pb.ModelStreamInferResponse]:
    """Every response of `count` requests on one stream, until the server ends each (the client closes
    its side after sending; the server ends the stream when every request is answered)."""
    requests = [kserve.request(model, {"X": x}, request_id=f"r{i}") for i in range(count)]
    return list(kserve.stub(server.channel).ModelStreamInfer(iter(requests), timeout=120))


def _values(responses) -> list[list[float]]:
    assert all(not r.error_message for r in responses), [r.error_message for r in responses]
    return sorted(kserve.outputs(r.infer_response)["Y"].tolist() for r in responses)


def test_each_response_of_a_decoupled_step_runs_the_rest_of_the_pipeline(server):
    x = np.array([1.0, 2.0], np.float32)
    # fan_two: x, x+10; each through fan_three: +0, +100, +200; each through twice: six answers
    expected = sorted((2 * (x + a + b)).tolist() for a in (0, 10) for b in (0, 100, 200))
    assert _values(_stream(server, "fan_fan_twice", x)) == expected


def test_a_decoupled_last_step_answers_for_each_of_its_responses(server):
    x = np.array([3.0], np.float32)
    assert _values(_stream(server, "twice_fan", x)) == [[6.0], [16.0]]


def test_requests_on_one_stream_each_get_all_their_responses(server):
    x = np.array([1.0], np.float32)
    responses = _stream(server, "twice_fan", x, count=3)
    by_id: dict[str, list] = {}
    for r in responses:
        by_id.setdefault(r.infer_response.id, []).append(kserve.outputs(r.infer_response)["Y"].tolist())
    assert {k: sorted(v) for k, v in by_id.items()} == {f"r{i}": [[2.0], [12.0]] for i in range(3)}


def test_a_step_that_sends_no_response_ends_the_request_with_none(server):
    assert _stream(server, "fan_none_twice", np.array([1.0], np.float32)) == []
    assert _values(_stream(server, "twice_fan", np.array([1.0], np.float32))) == [[2.0], [12.0]]  # still serving


def test_model_infer_refuses_the_decoupled_ensemble_and_names_the_streaming_call(server):
    with pytest.raises(grpc.RpcError) as err:
        kserve.infer(server.channel, "twice_fan", {"X": np.array([1.0], np.float32)})
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "ModelStreamInfer" in err.value.details()
    # an ensemble of plain steps still answers ModelInfer once
    assert kserve.infer(server.channel, "plain", {"X": np.array([1.0], np.float32)})["Y"].tolist() == [4.0]


def test_a_failing_fork_fails_its_request_alone(server):
    # fan_down sends X then X - 10: the second fork reaches twice with a negative value, which raises
    responses = _stream(server, "fan_down_twice", np.array([5.0], np.float32))
    errors = [r.error_message for r in responses if r.error_message]
    assert len(errors) == 1
    assert "ensemble 'fan_down_twice' step 1 (model 'twice')" in errors[0] and "negative input" in errors[0]
    # the first fork's answer, when it came before the failure, is the right one
    assert all(kserve.outputs(r.infer_response)["Y"].tolist() == [10.0] for r in responses if not r.error_message)
    # the same stream shape, a request that does not fail, is served in full afterwards
    assert _values(_stream(server, "fan_down_twice", np.array([20.0], np.float32))) == [[20.0], [40.0]]


def test_model_metadata_and_statistics_of_the_steps_count_every_fork(server):
    before = kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name="twice")).model_stats[0]
    _stream(server, "fan_fan_twice", np.array([0.0], np.float32))
    after = kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name="twice")).model_stats[0]
    assert after.inference_stats.success.count - before.inference_stats.success.count == 6
