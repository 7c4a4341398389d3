"""The records that cross the front end <-> engine link (server/ipc/frames.py carries them).

NamedTuples: they pickle as tuples (a few hundred bytes, a few microseconds) and still read by name.
A tensor is either in the arena (`offset` set, `data` None) or inline (`data` its raw KServe bytes).
Errors travel as a gRPC status name and the message the client will read, decided where they arose.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from server.ipc.tensors import Tensor

# Frame kinds. Front end -> engine: HELLO(index, pid), INFER(InferCall), CANCEL(rid), FREE(offsets in the
# answer half), SENT(rid, send start ns, send end ns: a traced answer's send). Engine -> front end:
# DONE(rid, version, [Tensor], response parameters), TRACED (DONE's layout, for a call the engine traces:
# the front end answers SENT), ERROR(rid, status name, message), FREE(offsets in the request half whose
# last numpy view is gone), STOP(grace_s: drain is over, stop serving), TRACING(on: whether any call may
# be traced; tracing/hop.py).
HELLO, INFER, CANCEL, FREE, DONE, ERROR, STOP = "hello", "infer", "cancel", "free", "done", "error", "stop"
TRACED, TRACING, SENT = "traced", "tracing", "sent"


class InferCall(NamedTuple):
    """One ModelInfer, decoded by the front end; the engine checks it against the model and runs it."""

    rid: int  # the front end's own id for the call, unique on its link
    model_name: str
    model_version: str
    id: str
    inputs: list[Tensor]
    parameters: dict[str, Any]
    requested: tuple[str, ...]  # output names asked for (empty: all)
    output_parameters: tuple[tuple[str, dict], ...]  # (output name, its decoded parameters)
    arrival_ns: int  # CLOCK_MONOTONIC, the same clock in every process of the machine
    remaining_s: float | None  # the gRPC deadline's remaining time at arrival
    nbytes: int  # the input data as received: the byte budgets' charge
    input_error: tuple[str, str] | None = None  # a refused tensor or parameter, answered after the model lookup
    output_error: tuple[str, str] | None = None  # a refused output parameter, answered after the signature check
    carrier: dict[str, str] | None = None  # W3C trace context metadata, sent only while tracing is on
