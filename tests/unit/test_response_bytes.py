"""ModelInferResponse bytes spliced from cached parts are exactly protobuf's own serialization."""

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from server.doors.grpc import codec
from server.doors.grpc.response_bytes import _varint, response_bytes, tensor_response_bytes

RNG = np.random.default_rng(7)

CASES = [
    ("light", "", 1, {"y": RNG.standard_normal((1, 16)).astype(np.float32)}, ("y",)),
    ("light", "req-42", 3, {"y": RNG.standard_normal((5, 16)).astype(np.float32)}, ("y",)),
    ("m", "ü" * 70, 12, {"a": np.arange(300, dtype=np.int64).reshape(3, 100), "b": np.zeros((0, 4), np.float16)},
     ("b", "a")),  # a multi-byte id over 127 bytes; an empty tensor; order not the dict's
    ("text", "x", 1, {"s": np.array([b"ab", b"", "ü".encode()], dtype=object).reshape(1, 3)}, ("s",)),
    ("big", "", 1, {"z": RNG.integers(0, 255, (1, 70_000), dtype=np.uint8)}, ("z",)),  # three-byte length
    ("view", "v", 2, {"y": RNG.standard_normal((4, 8)).astype(np.float32)[1:3, ::2]}, ("y",)),  # a strided view
    ("scalar", "", 1, {"y": np.array(3.5, np.float64), "n": np.ones((2, 2), bool)}, ("n", "y")),
]


@pytest.mark.parametrize("model, request_id, version, outputs, order", CASES)
def test_spliced_bytes_equal_protobufs_serialization(model, request_id, version, outputs, order):
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    expected = codec.encode_response(request, version, outputs, order).SerializeToString()
    assert response_bytes(model, request_id, version, outputs, order) == expected
    parsed = pb.ModelInferResponse.FromString(response_bytes(model, request_id, version, outputs, order))  # cached layout
    assert parsed.id == request_id and [o.name for o in parsed.outputs] == list(order)


def test_layouts_do_not_leak_between_models_or_shapes():
    y1, y2 = np.ones((1, 16), np.float32), np.ones((2, 16), np.float32)
    first = pb.ModelInferResponse.FromString(response_bytes("a", "", 1, {"y": y1}, ("y",)))
    second = pb.ModelInferResponse.FromString(response_bytes("b", "", 2, {"y": y2}, ("y",)))
    assert (first.model_name, first.model_version, list(first.outputs[0].shape)) == ("a", "1", [1, 16])
    assert (second.model_name, second.model_version, list(second.outputs[0].shape)) == ("b", "2", [2, 16])


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16_383, 16_384, 2**31 - 1, 2**35])
def test_varint_matches_protobuf(value):
    encoded = pb.ModelInferResponse(raw_output_contents=[b""]).SerializeToString()  # tag + length 0
    assert encoded == b"\x32" + _varint(0)
    assert pb.InferParameter(int64_param=value).SerializeToString() == b"\x10" + _varint(value)


def test_wire_form_tensors_compose_the_same_bytes_from_any_buffer():
    """A front-end process's answer: API datatypes and raw buffers (views of its arena) instead of arrays."""
    arena = bytearray(RNG.integers(0, 255, 4096, dtype=np.uint8).tobytes())
    a = np.frombuffer(arena, np.float32, 16, 64).reshape(1, 16)
    b = np.frombuffer(arena, np.int64, 3, 512).reshape(1, 3)
    request = pb.ModelInferRequest(model_name="m", id="abc")
    expected = codec.encode_response(request, 2, {"a": a, "b": b}, ("a", "b")).SerializeToString()
    view = memoryview(arena)
    layout = (("a", "FP32", (1, 16)), ("b", "INT64", (1, 3)))
    assert tensor_response_bytes("m", "abc", 2, layout, [view[64:128], bytes(view[512:536])]) == expected
