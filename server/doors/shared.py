"""What every front door does the same way once it has read its wire format.

Find the runner that can serve a call (or say why none can), and turn named numpy arrays plus the
request's parameters into a checked `InferRequest`; answer Triton's classification extension. gRPC (rpc/)
and HTTP (web/) both call these, so a tensor or parameter is accepted or refused with the same message
whichever door it came through.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from server.errors import InvalidInputError, UnsupportedError
from server.names import capped
from server.observability import traffic
from server.repository.registry import ModelVersion, Registry
from server.request import InferRequest, with_parameters_of
from server.tensors import classification
from server.runners.base import DECOUPLED, GENERATE, INFER


def serving(registry: Registry, name: str, version: str, serves: str) -> ModelVersion:
    """The ready version of `name` whose runner serves `serves` (INFER or GENERATE); raises otherwise."""
    mv = registry.get(name, version)
    if mv.runner.serves == serves:
        return mv
    if serves == INFER and mv.runner.serves == DECOUPLED:
        raise UnsupportedError(f"ModelInfer does not serve model '{mv.name}': its transaction policy is decoupled "
                               "(0..N responses per request); send its requests on ModelStreamInfer")
    if serves == INFER:
        raise UnsupportedError(
            f"model '{mv.name}' is a generation model (decoupled): it streams tokens instead of answering one infer; "
            f"use ModelStreamInfer or ferry.generate.v1.Generation/Generate over gRPC, or /v2/models/{mv.name}/generate "
            "and /v1/completions over HTTP")
    if serves == GENERATE:
        raise InvalidInputError(f"model '{mv.name}' is not a generation model (its backend is {mv.config.backend!r})")
    raise UnsupportedError(f"model '{mv.name}' cannot serve {serves!r} calls")


def infer_request(mv: ModelVersion, inputs: dict[str, np.ndarray], requested: tuple[str, ...], params: dict[str, Any],
                  request_id: str, arrival_ns: int, remaining_s: float | None, nbytes: int | None = None) -> InferRequest:
    """Check tensors against the model's signature and the reserved parameters; build the request.

    `nbytes`: the input data the request holds while queued (its byte budget's charge); by default
    the decoded arrays' size, which a front door replaces where it knows the bytes received."""
    signature = mv.signature
    batch_size, key = signature.check_inputs(inputs)
    if requested:
        signature.check_outputs(requested)
    priority = timeout_us = cost = 0
    if params:  # most requests carry none
        params = dict(params)
        priority, timeout_us = params.pop("priority", 0), params.pop("timeout", 0)
        for name, value in (("priority", priority), ("timeout", timeout_us)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"parameter '{name}' must be a non-negative integer, got {capped(repr(value), 100)}")
        cost = params.pop("cost", 0)  # per row, for cost-aware batching; 0: derived from the length
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
            raise InvalidInputError(f"parameter 'cost' must be a non-negative number, got {capped(repr(cost), 100)}")
    else:
        params = {}  # the request's own dict, never one a caller passed in
    traffic.infer(mv.name, arrival_ns, inputs)  # --record-traffic; a no-op otherwise
    return InferRequest(
        model_name=mv.name, inputs=inputs, batch_size=batch_size, batch_key=key, id=request_id,
        requested_outputs=requested, parameters=params, priority=priority, timeout_us=timeout_us,
        deadline_ns=arrival_ns + int(remaining_s * 1e9) if remaining_s is not None else None,
        arrival_ns=arrival_ns, length=mv.signature.length(inputs), cost=float(cost),
        nbytes=sum(a.nbytes for a in inputs.values()) if nbytes is None else nbytes,
    )


async def model_ready(mv: ModelVersion) -> bool:
    """Ready to serve: loaded and ready, and ready by the model's own check where it has one (is_ready)."""
    if mv.cold:
        return True  # on-demand model control: its first request loads it, so it can serve
    check = getattr(mv.runner, "model_ready", None) if mv.ready else None
    return mv.ready and (check is None or await check())


def class_counts(wanted, signature) -> dict[str, int]:
    """Requested outputs carrying the `classification` parameter -> k; checked at decode, before any work.

    `wanted`: (output name, decoded parameters) of the outputs that carry it, in request order (lazily
    decoded, so a bad parameter is refused in the same order whichever door read it)."""
    counts = {}
    for name, params in wanted:
        counts[name] = classification.requested_k(name, params["classification"])
        if signature.outputs[name].datatype.api == "BYTES":
            raise InvalidInputError(f"output '{name}' is BYTES and cannot be classified")
    return counts


def classified(outputs: dict, counts: dict[str, int], signature) -> dict:
    """Outputs asked for with the `classification` parameter, replaced by their top-k classes."""
    classes = dict(outputs)
    for name, k in counts.items():
        classes[name] = classification.classify(name, outputs[name], k, signature.labels.get(name, ()), signature.batching)
    return with_parameters_of(classes, outputs)
