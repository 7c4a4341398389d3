"""Protobuf tensors <-> numpy, and the checks a request passes before it is queued."""

from __future__ import annotations

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from protos import model_config_pb2 as mc
from server.errors import InvalidInputError
from server.doors.grpc import codec
from server.tensors.signature import Signature


def raw_request(name, datatype, shape, data: bytes) -> pb.ModelInferRequest:
    r = pb.ModelInferRequest(model_name="m")
    r.inputs.add(name=name, datatype=datatype, shape=shape)
    r.raw_input_contents.append(data)
    return r


def test_raw_numeric_input_is_a_view_over_the_received_bytes():
    data = np.arange(6, dtype=np.int32).tobytes()
    request = raw_request("x", "INT32", [2, 3], data)
    array = codec.decode_inputs(request)["x"]
    assert array.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert not array.flags.owndata  # no copy was made


def test_a_tensor_header_seen_before_decodes_and_is_refused_as_the_first_time():
    """Raw tensors are decoded from what their header (name, datatype, shape) was found to mean the first time
    it came: the arrays, the views and every refusal must be those of the full decode."""
    def two(a_bytes: bytes, b_name="b", b_params=False):
        r = raw_request("a", "FP32", [1, 2], a_bytes)
        tensor = r.inputs.add(name=b_name, datatype="INT64", shape=[1, 3])
        if b_params:
            tensor.parameters["shared_memory_region"].string_param = "r"
        else:
            r.raw_input_contents.append(np.array([[7, 8, 9]], np.int64).tobytes())
        return r

    good = np.array([[1.5, -2.0]], np.float32).tobytes()
    first, again = codec.decode_inputs(two(good)), codec.decode_inputs(two(good))
    for decoded in (first, again):
        assert decoded["a"].dtype == np.float32 and decoded["a"].tolist() == [[1.5, -2.0]]
        assert decoded["b"].dtype == np.int64 and decoded["b"].tolist() == [[7, 8, 9]]
        assert not decoded["a"].flags.owndata and not decoded["a"].flags.writeable  # views over the received bytes
    for _ in range(2):  # the header is known now; the wrong size is still refused with the full decode's words
        with pytest.raises(InvalidInputError, match="raw content is 4 bytes but shape"):
            codec.decode_inputs(two(good[:4]))
        with pytest.raises(InvalidInputError, match="appears twice"):
            codec.decode_inputs(two(good, b_name="a"))
        with pytest.raises(InvalidInputError, match="dimension -1"):
            codec.decode_inputs(raw_request("a", "FP32", [-1, 2], good))
    # A header naming a shared memory region is always the full decode's: the region is read.
    read = []
    def read_shared(tensor, dtype, shape):
        read.append(tensor.name)
        return np.zeros(shape, dtype.numpy)
    decoded = codec.decode_inputs(two(good, b_params=True), read_shared)
    assert read == ["b"] and decoded["b"].shape == (1, 3) and decoded["a"].tolist() == [[1.5, -2.0]]


def test_long_tensor_headers_are_decoded_but_never_kept():
    """What a header was found to mean is kept only for short headers: a client sending huge names holds no
    memory in the decoder between its requests."""
    long_name = "n" * 100_000
    kept = codec._raw_plan.cache_info().currsize
    for _ in range(2):
        decoded = codec.decode_inputs(raw_request(long_name, "INT32", [2], np.array([4, 5], np.int32).tobytes()))
        assert decoded[long_name].tolist() == [4, 5]
    assert codec._raw_plan.cache_info().currsize == kept


def test_bytes_round_trip_with_length_prefixes():
    values = np.array([b"ab", b"", "é".encode(), b"\x00\xff"], dtype=object).reshape(2, 2)
    raw = codec.to_raw(values)
    assert raw[:6] == b"\x02\x00\x00\x00ab"
    decoded = codec.decode_inputs(raw_request("s", "BYTES", [2, 2], raw))["s"]
    assert decoded.tolist() == values.tolist()


@pytest.mark.parametrize("raw, count, words", [
    (b"\x05\x00\x00\x00ab", 1, "past the end"), (b"\x01\x00\x00\x00a\x00\x00\x00", 2, "ends after"),
    (b"\x01\x00\x00\x00a\x01\x00\x00\x00bX", 2, "left over"),
])
def test_malformed_bytes_are_refused(raw, count, words):
    with pytest.raises(InvalidInputError, match=words):
        codec.decode_inputs(raw_request("s", "BYTES", [count], raw))


def test_unknown_datatype_and_reserved_parameter_are_refused():
    with pytest.raises(InvalidInputError, match="unknown datatype 'FLOAT'"):
        codec.decode_inputs(raw_request("x", "FLOAT", [1], b"\x00" * 4))
    params = pb.ModelInferRequest().parameters
    params["triton_secret"].bool_param = True
    with pytest.raises(InvalidInputError, match="reserved"):
        codec.decode_parameters(params)


def test_parameters_decode_to_python_values():
    request = pb.ModelInferRequest()
    request.parameters["priority"].uint64_param = 2
    request.parameters["timeout"].int64_param = 1500
    request.parameters["note"].string_param = "hi"
    assert codec.decode_parameters(request.parameters) == {"priority": 2, "timeout": 1500, "note": "hi"}


def signature(max_batch=4) -> Signature:
    config = mc.ModelConfig(name="m", max_batch_size=max_batch)
    config.input.add(name="a", data_type=mc.TYPE_FP32, dims=[-1, 3])
    config.input.add(name="b", data_type=mc.TYPE_INT64, dims=[2])
    config.output.add(name="y", data_type=mc.TYPE_FP32, dims=[-1])
    return Signature.from_config(config)


def test_signature_batch_size_and_join_key():
    size, key = signature().check_inputs({"a": np.zeros((2, 5, 3), np.float32), "b": np.zeros((2, 2), np.int64)})
    assert size == 2 and key == (("a", (5, 3)), ("b", (2,)))


@pytest.mark.parametrize("inputs, words", [
    ({"a": np.zeros((1, 5, 3), np.float32)}, "missing required input"),
    ({"a": np.zeros((1, 5, 4), np.float32), "b": np.zeros((1, 2), np.int64)}, "expects \\[-1, -1, 3\\]"),
    ({"a": np.zeros((1, 5, 3), np.float32), "b": np.zeros((2, 2), np.int64)}, "disagree on the batch size"),
    ({"a": np.zeros((5, 1, 3), np.float32), "b": np.zeros((5, 2), np.int64)}, "exceeds max_batch_size 4"),
    ({"a": np.zeros((1, 1, 3), np.float64), "b": np.zeros((1, 2), np.int64)}, "FP64.*expects FP32"),
])
def test_signature_refusals_name_the_problem(inputs, words):
    with pytest.raises(InvalidInputError, match=words):
        signature().check_inputs(inputs)


def test_the_one_pass_check_accepts_exactly_what_the_full_check_accepts():
    """A model with nothing optional, padded or read as text has its usual requests checked in one pass;
    whatever that pass accepts must come out as the full check gives it, and what it does not take is
    left to the full check (the refusals above come from there)."""
    unbatched = mc.ModelConfig(name="u")
    unbatched.input.add(name="s", data_type=mc.TYPE_STRING, dims=[-1])
    unbatched.input.add(name="n", data_type=mc.TYPE_INT32, dims=[2, 2])
    cases = [
        (signature(), {"a": np.zeros((2, 5, 3), np.float32), "b": np.zeros((2, 2), np.int64)}),
        (signature(), {"b": np.zeros((1, 2), np.int64), "a": np.zeros((1, 0, 3), np.float32)}),
        (signature(), {"a": np.zeros((4, 1, 3), np.float32), "b": np.zeros((4, 2), np.int64)}),
        (Signature.from_config(unbatched), {"s": np.array([b"x", b"yz"], dtype=object), "n": np.zeros((2, 2), np.int32)}),
    ]
    for sig, inputs in cases:
        assert sig._plain
        fast = sig._plain_inputs(inputs)
        assert fast is not None and fast == sig._checked_inputs(inputs) == sig.check_inputs(inputs)
    for bad in ({"a": np.zeros((1, 5, 3), np.float32)}, {"a": np.zeros((5, 1, 3), np.float32), "b": np.zeros((5, 2), np.int64)},
                {"a": np.zeros((1, 5, 4), np.float32), "b": np.zeros((1, 2), np.int64)}):
        assert signature()._plain_inputs(bad) is None


def test_bytes_shape_larger_than_the_content_is_refused_before_allocating():
    with pytest.raises(InvalidInputError, match="cannot hold"):
        codec.decode_inputs(raw_request("s", "BYTES", [2**30], b"\x01\x00\x00\x00a"))


def test_typed_narrow_integers_out_of_range_are_refused():
    request = pb.ModelInferRequest(model_name="m")
    tensor = request.inputs.add(name="x", datatype="INT8", shape=[2])
    tensor.contents.int_contents.extend([1, 300])
    with pytest.raises(InvalidInputError, match="INT8 range"):
        codec.decode_inputs(request)
    tensor.contents.int_contents[1] = -128
    assert codec.decode_inputs(request)["x"].tolist() == [1, -128]


@pytest.mark.parametrize("elements, bad", [
    ([b"caf\xc3\xa9", b"ok"], None),
    ([b"\xc3", b"\xa9"], 0),  # a character split across two elements: each alone is invalid
    ([b"fine", b"\xa9tail"], 1),  # a stray continuation byte at an element's start
    ([b"nul\x00inside", "text"], None),  # NUL is valid UTF-8; str elements are text already
])
def test_text_bytes_inputs_are_checked_for_utf8_per_element(elements, bad):
    config = mc.ModelConfig(name="m", max_batch_size=4)
    config.input.add(name="s", data_type=mc.TYPE_STRING, dims=[-1])
    config.output.add(name="o", data_type=mc.TYPE_STRING, dims=[-1])
    value = np.array([elements], dtype=object)
    Signature.from_config(config).check_inputs({"s": value})  # a model that takes BYTES as bytes: no check
    text = Signature.from_config(config, text_bytes=True)
    if bad is None:
        assert text.check_inputs({"s": value})[0] == 1
    else:
        with pytest.raises(InvalidInputError, match=f"'s' element {bad} is not valid UTF-8"):
            text.check_inputs({"s": value})
