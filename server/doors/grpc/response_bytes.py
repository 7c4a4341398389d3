"""A ModelInferResponse's bytes composed from parts serialized once per output layout.

Most responses of a model differ only in their id and their tensors' bytes: the model name, the version
and every output's name, datatype and shape are the same for each request of a batch, and for each batch
of requests of the same shape. Building a protobuf message per response (a message, one output entry per
tensor, its shape copied field by field) and serializing it was the door's largest cost per request after
decoding. Here the constant parts are serialized once per (model, version, names, dtypes, shapes), by
protobuf itself, and a response is those bytes with its id and raw contents spliced in, in field order:
the result is byte for byte what `encode_response(...).SerializeToString()` gives (tests hold it so).

Only for the plain case: a response with parameters of its own (a Triton Python model's) or an output
written to shared memory goes through `codec.encode_response`.
"""

from __future__ import annotations

import functools

import numpy as np

from protos import grpc_service_pb2 as pb
from server.tensors import datatypes
from server.tensors.wire import to_raw

_ID_TAG = b"\x1a"  # field 3 (id), length-delimited
_RAW_TAG = b"\x32"  # field 6 (raw_output_contents), length-delimited
_LAYOUTS = 4096  # distinct (model, version, output layout) kept; a model of varying shapes cycles through them


def response_bytes(model_name: str, request_id: str, version: int, outputs: dict[str, np.ndarray],
                   order: tuple[str, ...]) -> bytes:
    """The serialized ModelInferResponse answering `outputs` (in `order`), raw contents only."""
    arrays = [outputs[name] for name in order]
    head, tail = _array_layout(model_name, version, tuple((name, a.dtype, a.shape) for name, a in zip(order, arrays)))
    return _compose(head, request_id, tail, [to_raw(a) for a in arrays])


def tensor_response_bytes(model_name: str, request_id: str, version: int, layout: tuple, raws: list) -> bytes:
    """The same for tensors already in wire form (a front-end process's answer, server/doors/processes):
    `layout` ((name, API datatype, shape) per output), `raws` each one's bytes (any buffer: a view of the
    arena is copied once, into the reply)."""
    head, tail = _layout(model_name, version, layout)
    return _compose(head, request_id, tail, raws)


def _compose(head: bytes, request_id: str, tail: bytes, raws: list) -> bytes:
    parts = [head]
    if request_id:
        parts += (_ID_TAG, _varint(len(encoded := request_id.encode())), encoded)
    parts.append(tail)
    for raw in raws:
        parts += (_RAW_TAG, _varint(len(raw) if raw.__class__ is bytes else memoryview(raw).nbytes), raw)
    return b"".join(parts)


@functools.lru_cache(maxsize=_LAYOUTS)
def _array_layout(model_name: str, version: int, layout: tuple) -> tuple[bytes, bytes]:
    """`_layout` keyed by numpy dtypes (no API name looked up per reply)."""
    return _layout(model_name, version, tuple((name, datatypes.from_numpy(dtype).api, shape)
                                              for name, dtype, shape in layout))


@functools.lru_cache(maxsize=_LAYOUTS)
def _layout(model_name: str, version: int, layout: tuple) -> tuple[bytes, bytes]:
    """(fields 1-2: model name and version; field 5: the output entries), serialized by protobuf."""
    head = pb.ModelInferResponse(model_name=model_name, model_version=str(version)).SerializeToString()
    entries = pb.ModelInferResponse()
    for name, datatype, shape in layout:
        entries.outputs.add(name=name, datatype=datatype, shape=shape)
    return head, entries.SerializeToString()


def _varint(value: int) -> bytes:
    """Protobuf's base-128 varint: seven bits a byte, low bits first, the high bit set on all but the last."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
