"""A decoupled BLS call's `cancel()` (Triton's response iterator's) cancels the called request; it does not
end the iterator. As in Triton (qa/L0_backend_python/decoupled, test_decoupled_bls_cancel and
test_decoupled_bls_ignore_cancel): a called model that honours the cancellation ends its stream with
a CANCELLED error, and one that ignores it goes on, every response it sends reaching the caller."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer

_TICKER_CONFIG = """
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "IGNORE", data_type: TYPE_BOOL, dims: [ 1 ] } ]
output [ { name: "ONE", data_type: TYPE_INT32, dims: [ 1 ] },
         { name: "SAW", data_type: TYPE_BOOL, dims: [ 1 ] } ]
"""

# Sends 1 up to 12 times, waiting after the 3rd for the cancellation; honours it unless IGNORE. SAW: it had seen it.
_TICKER = textwrap.dedent('''
    import time

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            request = requests[0]
            ignore = bool(pb_utils.get_input_tensor_by_name(request, "IGNORE").as_numpy()[0])
            sender = request.get_response_sender()
            for sent in range(12):
                if request.is_cancelled() and not ignore:
                    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                        "ticker: cancelled", pb_utils.TritonError.CANCELLED)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return None
                outputs = [pb_utils.Tensor("ONE", np.array([1], np.int32)),
                           pb_utils.Tensor("SAW", np.array([request.is_cancelled()]))]
                last = sent == 11
                sender.send(pb_utils.InferenceResponse(outputs),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)
                if sent == 2:  # the caller cancels after 3: wait for it (bounded), so the rest come after it
                    waited = time.monotonic()
                    while not request.is_cancelled() and time.monotonic() - waited < 60:
                        time.sleep(0.01)
            return None
''')

_SUMMER_CONFIG = """
backend: "python"
input [ { name: "IGNORE", data_type: TYPE_BOOL, dims: [ 1 ] } ]
output [ { name: "SUM", data_type: TYPE_INT32, dims: [ 1 ] },
         { name: "CANCELLED", data_type: TYPE_BOOL, dims: [ 1 ] },
         { name: "SAW", data_type: TYPE_BOOL, dims: [ 1 ] } ]
"""

# Reads the ticker's responses, cancels the call once 3 came (and again for every later one, as Triton's
# own test does), and answers what it got.
_SUMMER = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            request = requests[0]
            call = pb_utils.InferenceRequest(model_name="ticker", requested_output_names=["ONE", "SAW"],
                                             inputs=[pb_utils.get_input_tensor_by_name(request, "IGNORE")])
            stream = call.exec(decoupled=True)
            total, cancelled, saw = 0, False, False
            for response in stream:
                if response.has_error():
                    cancelled = response.error().code() == pb_utils.TritonError.CANCELLED
                    break
                one = pb_utils.get_output_tensor_by_name(response, "ONE")
                if one is None:
                    continue  # an empty final response
                total += int(one.as_numpy()[0])
                saw = bool(pb_utils.get_output_tensor_by_name(response, "SAW").as_numpy()[0])
                if total >= 3:
                    stream.cancel()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("SUM", np.array([total], np.int32)),
                                                pb_utils.Tensor("CANCELLED", np.array([cancelled])),
                                                pb_utils.Tensor("SAW", np.array([saw]))])]
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name, config, model in (("ticker", _TICKER_CONFIG, _TICKER), ("summer", _SUMMER_CONFIG, _SUMMER)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
        (repo / name / "1" / "model.py").write_text(model)
    running = RunningServer(repo)
    yield running
    running.stop()


def _sum(server, ignore: bool) -> dict:
    outputs = kserve.infer(server.channel, "summer", {"IGNORE": np.array([ignore])})
    return {name: outputs[name].tolist()[0] for name in ("SUM", "CANCELLED", "SAW")}


def test_a_called_model_that_ignores_cancel_keeps_delivering_every_response(server):
    result = _sum(server, ignore=True)
    assert result == {"SUM": 12, "CANCELLED": False, "SAW": True}  # all 12, the last sent after it saw the cancel


def test_a_called_model_that_honours_cancel_ends_the_iterator_with_cancelled(server):
    result = _sum(server, ignore=False)
    assert result == {"SUM": 3, "CANCELLED": True, "SAW": False}
