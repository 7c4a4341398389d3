"""What Triton's own QA suite for the Python backend (qa/L0_backend_python) requires of a server, kept
as Ferry's tests: Triton's instance names, pb_utils error codes answered as Triton answers them, a
failed execute's message in Triton's words, response senders of models that are not decoupled and
their rules, a decoupled execute that returns a response, an async decoupled BLS call answered by its
first response (so the instance's loop goes on meanwhile) and without an empty last response when the
final flag came with one, models without inputs, FORCE_CPU_ONLY_INPUT_TENSORS "no" on a machine
without a GPU, the `triton_grpc_error` stream header, pb_utils' argument checks and an empty sys.argv. NVIDIA's tritonclient runs in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import python_triton_qa_models
from tests.conftest import RunningServer

if importlib.util.find_spec("tritonclient") is None:
    pytest.skip(reason="tritonclient[grpc,http] is not installed (it is part of the test extra)", allow_module_level=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo, gates = tmp_path_factory.mktemp("repo"), tmp_path_factory.mktemp("gates")
    python_triton_qa_models.build(repo, gates)
    server = RunningServer(repo)
    try:
        script = Path(__file__).with_name("python_triton_qa_calls.py")
        done = subprocess.run([sys.executable, str(script), server.address, server.http_address, str(gates)],
                              capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stderr
        yield server, json.loads(done.stdout)
    finally:
        server.stop()


def test_instance_name_carries_the_group_index(served):
    _, result = served
    assert result["name"] == {"out": ["qa_name_0_0"]}


@pytest.mark.parametrize("code, grpc_status, http_status", [
    ("UNKNOWN", "StatusCode.UNKNOWN", "400"), ("INTERNAL", "StatusCode.INTERNAL", "500"),
    ("NOT_FOUND", "StatusCode.NOT_FOUND", "404"), ("INVALID_ARG", "StatusCode.INVALID_ARGUMENT", "400"),
    ("UNAVAILABLE", "StatusCode.UNAVAILABLE", "503"), ("UNSUPPORTED", "StatusCode.UNIMPLEMENTED", "501"),
    ("ALREADY_EXISTS", "StatusCode.ALREADY_EXISTS", "409"), ("CANCELLED", "StatusCode.CANCELLED", "400")])
def test_triton_error_codes_reach_the_client_as_triton_maps_them(served, code, grpc_status, http_status):
    _, result = served
    assert result["codes_grpc"][code] == {"status": grpc_status, "message": f"code {code}"}
    assert result["codes_http"][code]["status"] == http_status
    assert result["codes_http"][code]["message"] == f"code {code}"


def test_a_triton_error_without_a_code_is_internal(served):
    _, result = served
    assert result["codes_grpc"]["default"] == {"status": "StatusCode.INTERNAL", "message": "no code given"}


def test_an_exception_in_execute_is_answered_in_tritons_words_and_logged(served):
    server, result = served
    expected = ("Failed to process the request(s) for model instance 'qa_raise_0_0', message: "
                "ValueError: qa_raise cannot take 1 request(s)")
    assert result["raise_grpc"] == {"status": "StatusCode.INTERNAL", "message": expected}
    assert result["raise_http"] == {"status": "500", "message": expected}
    assert "ValueError: qa_raise cannot take 1 request(s)" in server.output  # the server's log has it, as Triton's
    assert "Traceback" in server.output


def test_a_model_that_is_not_decoupled_may_answer_through_its_response_sender(served):
    server, result = served
    sender = result["sender"]
    assert sender["late"] == {"out": ["sent after execute returned"]}
    assert sender["twice"] == {"out": ["first"]}
    assert "qa_sender refused: Non-decoupled model cannot send more than one response" in server.output
    assert sender["both"] == {"out": ["from the sender"]}  # the response it returned as well is dropped


def test_the_final_flag_before_any_response_is_refused_for_a_model_that_is_not_decoupled(served):
    _, result = served
    answer = result["sender"]["final_first"]
    assert answer["status"] == "StatusCode.INTERNAL"
    assert "Non-decoupled model cannot send complete final before sending a response" in answer["message"]


def test_a_decoupled_execute_that_returns_a_response_fails_its_request_with_tritons_message(served):
    _, result = served
    [answer] = result["stream_return"]
    assert ("Python model 'qa_stream_0_0' is using the decoupled mode and the execute function must return None."
            in answer["message"])


def test_a_closed_response_sender_refuses_with_tritons_message(served):
    server, result = served
    assert result["stream_closed"] == [{"out": ["once"]}]
    assert "qa_stream refused: Unable to send response. Response sender has been closed." in server.output


def test_async_decoupled_bls_lets_the_next_request_start_and_adds_no_empty_last_response(served):
    """Request A's BLS call waits (in the called model) until request B's call got there: B's execute
    must start while A awaits its call, and each forwards exactly the one response its call sent with
    the final flag."""
    _, result = served
    assert sorted(a["out"][0] for a in result["async_bls"]) == ["A met B", "B"]
    assert len(result["async_bls"]) == 2


def test_a_model_without_inputs_loads_and_answers_a_request_without_inputs(served):
    _, result = served
    assert result["no_inputs_grpc"] == {"out": [0.0]}
    assert result["no_inputs_http"] == {"out": [0.0]}


def test_http_takes_a_request_without_inputs_when_they_are_optional(served):
    _, result = served
    assert result["optional_http"] == {"none": {"out": [-1.0]}, "given": {"out": [7.0]}}


def test_force_cpu_only_input_tensors_no_loads_and_gets_host_tensors(served):
    _, result = served
    assert result["gpu_inputs"] == {"out": [6.0]}


def test_triton_grpc_error_header_ends_the_stream_at_its_first_error(served):
    _, result = served
    assert result["grpc_error_stream"] == [{"status": "StatusCode.INVALID_ARGUMENT", "message": "code INVALID_ARG"}]
    plain = result["plain_error_stream"]  # without the header, errors travel on the stream, which goes on
    assert [a["message"] for a in plain] == ["code INVALID_ARG", "code UNKNOWN"]


def test_a_batching_model_without_inputs_is_refused_with_the_reason(tmp_path):
    (tmp_path / "nobatch" / "1").mkdir(parents=True)
    (tmp_path / "nobatch" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 4\noutput [ { name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    (tmp_path / "nobatch" / "1" / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    server = RunningServer(tmp_path)
    try:
        assert "a batching model needs an input to carry the batch dimension" in server.output
    finally:
        server.stop()


def test_pb_utils_refuses_arguments_of_the_wrong_type_as_tritons_bindings_do(served):
    _, result = served
    raised = json.loads(result["args"]["out"][0])
    assert raised == {
        "request_inputs_none": "TypeError", "request_input_element": "TritonModelException",
        "request_model_name": "TypeError", "request_outputs": "TypeError", "request_flags": "TypeError",
        "request_ok": "nothing", "response_none": "TypeError", "response_element": "TritonModelException",
        "response_ok": "nothing", "tensor_name": "TypeError", "tensor_data": "TypeError",
        "dlpack_none": "TritonModelException", "log_level_int": "TypeError", "log_none": "TypeError",
        "log_ok": "nothing", "log_alias": "nothing"}


def test_model_code_sees_no_command_line_arguments(served):
    """Triton's QA models call unittest.main() inside execute, which parses sys.argv."""
    _, result = served
    assert result["argv"] == {"out": ["[]"]}


def test_is_ready_must_answer_a_bool(served):
    _, result = served
    assert result["ready_int"] == [False, False]


def test_a_slow_is_ready_holds_up_no_request_and_is_asked_once_while_in_flight(served):
    _, result = served
    slow = result["ready_slow"]
    assert slow["first"] is False  # past Triton's 5 s
    assert slow["served"] == {"out": [2.0]}  # answered while is_ready still waited
    assert slow["second"] is True  # the check in flight answered it
    assert slow["calls"] == 1


def test_a_response_returned_for_a_rescheduled_request_fails_it_with_tritons_message(served):
    _, result = served
    assert result["resched_returns"] == {
        "status": "StatusCode.INTERNAL",
        "message": "Expected a None object in the execute function return list for reschduled request"}


def test_model_py_imports_files_of_its_folder_relatively(served):
    _, result = served
    assert result["package"] == {"out": [7.0]}
