"""What a model process and its instance in the server say to each other (over server/ipc/frames.py).

Frames are tuples whose first item is the kind, and everything in them is a plain tuple, list, dict,
str, number or bytes: a Request, Reply, Call or Tensor travels as a plain tuple laid out as its class
below (`tuple(record)`; the reader rebuilds one with `record(Class, wire)` where it reads fields by
name). Pickling a NamedTuple looks its class up by name and calls Python code for it on both ends:
77 us to pickle and 47 us to unpickle an EXEC of one add_sub request, against 12 and 14 us as plain
tuples (on a busy 2-core machine). Tensors are `server.ipc.tensors.Tensor` records: the
server writes requests (and BLS answers) into the first half of the instance's arena, the model
process writes responses (and BLS calls) into the second; each side frees only in its own half, told
by the side that read the block: in the `freed` list of its next EXEC, STREAM or DONE (a FREE frame
when many wait).

Server -> model process:
  INIT(args)                             load model.py, initialize(args); answered READY(face, has is_ready) or
                                         FAILED(message)
  CHECK(ref)                             the model's is_ready(); answered CHECKED(ref, bool)
  AUTO(config_json)                      auto_complete_config only; answered AUTO(config_json) or FAILED(message)
  EXEC(call, [Request], freed)           run execute; answered DONE(call, [Reply | RESCHEDULE], freed, ns): ns
                                         is how long the model process took over it, execute and frames
  EXECS([(call, [Request])], freed)      a train: several executes of a model that does not batch, run one
                                         after another, each answered by its own DONE as an EXEC is
  STREAM([call], [Request], freed)       decoupled requests run by one execute, a call each; each answered
                                         RESPONSE(call, Reply | None, final) 0..N times (None: the final
                                         flag alone) and, once execute returns,
                                         RESPONSE(call, EXECUTED, False) (its responses may still come after:
                                         the instance takes its next request) or RESPONSE(call, RESCHEDULE,
                                         False): the request was rescheduled; the server sends STREAM again
                                         under the same call
  CANCEL(call)                           the callers of an EXEC or STREAM went away (is_cancelled() turns true;
                                         the server cancels the BLS calls it made, answered CALLED CANCELLED)
  CALLED(ref, Reply | None, final)       an answer to a BLS call or a model-control call
  FREE([offsets])                        blocks of the model process's half the server is done with
  FINALIZE()                             finalize() and exit
  HANDOVER()                             echoed at once: the server's event loop reads the link after it
Model process -> server:
  CALL(ref, Call, call)                  BLS: run a request on another model's runner (for EXEC or STREAM `call`)
  UNCALL(ref)                            model code cancelled its decoupled BLS call (the response iterator's
                                         cancel()): its request is cancelled; CALLED frames go on until the final one
  CONTROL(ref, op, name, version, config) load_model / unload_model / is_model_ready
  METRIC(ref, op, family, labels, value) custom metrics: the server owns the Prometheus families; CALLED acks
  LOG(level, message)                    pb_utils.Logger
  CHECKED(ref, ready)                    is_ready()'s answer
  FREE([offsets])                        blocks of the server's half the model is done with
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

from server.ipc.tensors import Tensor

INIT, AUTO, EXEC, STREAM, CANCEL, CALLED, FREE, FINALIZE = (
    "init", "auto", "exec", "stream", "cancel", "called", "free", "finalize")
READY, FAILED, DONE, RESPONSE, CALL, CONTROL, METRIC, LOG = (
    "ready", "failed", "done", "response", "call", "control", "metric", "log")
CHECK, CHECKED, HANDOVER, UNCALL, EXECS = "check", "checked", "handover", "uncall", "execs"
RESCHEDULE = "reschedule"  # in place of a Reply: the model released the request to run it again later
EXECUTED = "executed"  # in place of a Reply: a decoupled request's execute returned

TRITON, FERRY = "triton", "ferry"  # the two faces of a model.py: `class TritonPythonModel` or `class Model`

# Triton's error codes (pb_utils.TritonError), as the numbers its stub uses.
UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)


_R = TypeVar("_R", bound=tuple)
_new = tuple.__new__


def record(cls: type[_R], wire: tuple) -> _R:
    """A record's class over the plain tuple it travelled as (one C call, no copy of its fields)."""
    return _new(cls, wire)


class Request(NamedTuple):
    """One request as the model sees it (Triton's InferenceRequest accessors read these)."""

    id: str
    inputs: list[Tensor]
    requested: tuple[str, ...]
    parameters: dict[str, Any]
    correlation_id: int | str = 0
    flags: int = 0
    timeout_us: int = 0  # the request's own timeout (a client's `timeout` parameter, a BLS call's `timeout=`)


class Reply(NamedTuple):
    """One response: outputs, or an error (a Triton error code and the message the caller reads)."""

    outputs: list[Tensor]
    error: tuple[int, str] | None = None
    parameters: dict[str, Any] | None = None


class Call(NamedTuple):
    """A BLS request from model code: run on the named model's runner, as a client's request would."""

    model: str
    version: str  # "" for the latest ready version
    inputs: list[Tensor]
    requested: tuple[str, ...]
    parameters: dict[str, Any]
    request_id: str
    timeout_us: int
    decoupled: bool
    trace: tuple[int, int] | None = None  # `trace=request.trace()`: (its EXEC or STREAM call, the request's index)
    correlation_id: int | str = 0  # a stateful model's sequence (Triton's BLS with stateful models)
    flags: int = 0  # TRITONSERVER_REQUEST_FLAG_SEQUENCE_START / _END
