"""Padding rules from a config, padded gathering and trimming, as plain numpy."""

from __future__ import annotations

import numpy as np
import pytest

from protos import model_config_pb2 as mc
from server.errors import BackendError, ConfigError, InvalidInputError
from server.tensors.assembly import PaddedAssembler
from server.tensors.padding import Padding
from server.request import Batch, InferRequest
from server.tensors.signature import Signature


def config(**x_fields) -> mc.ModelConfig:
    c = mc.ModelConfig(name="m", max_batch_size=8)
    fields = {"variable_length": True, "padding_value": -1, "lengths_input": "len", "mask_input": "mask", **x_fields}
    c.input.add(name="x", data_type=mc.TYPE_FP32, dims=[-1, 2], **fields)
    c.input.add(name="ids", data_type=mc.TYPE_INT64, dims=[-1], variable_length=True)
    c.input.add(name="len", data_type=mc.TYPE_INT32, dims=[1])
    c.input.add(name="mask", data_type=mc.TYPE_BOOL, dims=[-1])
    c.output.add(name="y", data_type=mc.TYPE_FP32, dims=[-1, 2], variable_length=True)
    c.output.add(name="pooled", data_type=mc.TYPE_FP32, dims=[2])
    return c


def request(rows: int, length: int, start: float = 1) -> InferRequest:
    x = np.arange(start, start + rows * length * 2, dtype=np.float32).reshape(rows, length, 2)
    ids = np.full((rows, length), length, np.int64)
    return InferRequest("m", {"x": x, "ids": ids}, rows, (), length=length)


def test_gather_pads_to_the_longest_and_fills_lengths_and_mask():
    padding = Padding.from_config(config())
    short, long = request(2, 1), request(1, 3, start=100)
    inputs, count = PaddedAssembler(padding).gather(Batch([short, long], True))
    assert inputs["x"].shape == (3, 3, 2) and inputs["ids"].shape == (3, 3)
    np.testing.assert_array_equal(inputs["x"][:2, :1], short.inputs["x"])
    assert (inputs["x"][:2, 1:] == -1).all()  # padding_value
    assert (inputs["ids"][:2, 1:] == 0).all()  # default padding value
    np.testing.assert_array_equal(inputs["x"][2], long.inputs["x"][0])
    assert inputs["len"].dtype == np.int32 and inputs["len"].tolist() == [[1], [1], [3]]
    assert inputs["mask"].dtype == np.bool_ and inputs["mask"].tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 1]]
    assert (count.padded, count.computed) == (4, 9)  # 3 rows x 3 positions, 5 of them real


def test_equal_lengths_are_joined_without_padding():
    padding = Padding.from_config(config())
    a, b = request(1, 2), request(1, 2, start=50)
    inputs, count = PaddedAssembler(padding).gather(Batch([a, b], True))
    np.testing.assert_array_equal(inputs["x"], np.concatenate([a.inputs["x"], b.inputs["x"]]))
    assert (count.padded, count.computed) == (0, 4)


def test_trim_slices_variable_outputs_back_to_each_length():
    padding = Padding.from_config(config())
    requests = [request(1, 1), request(1, 3)]
    y = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    split = PaddedAssembler(padding).split(Batch(requests, True), {"y": y, "pooled": np.ones((2, 2))})
    assert split[0]["y"].shape == (1, 1, 2) and split[1]["y"].shape == (1, 3, 2)
    assert split[0]["pooled"].shape == (1, 2)
    with pytest.raises(BackendError, match="padded length 3"):
        PaddedAssembler(padding).split(Batch(requests, True), {"y": y[:, :2]})


def test_signature_joins_lengths_and_hides_filled_inputs():
    signature = Signature.from_config(config())
    assert sorted(signature.inputs) == ["ids", "x"]
    _, key_a = signature.check_inputs(request(1, 2).inputs)
    _, key_b = signature.check_inputs(request(1, 7).inputs)
    assert key_a == key_b
    assert signature.length(request(1, 7).inputs) == 7
    with pytest.raises(InvalidInputError, match="share one length"):
        signature.length({"x": np.zeros((1, 2, 2), np.float32), "ids": np.zeros((1, 3), np.int64)})
    with pytest.raises(InvalidInputError, match="filled in by the server"):
        signature.check_inputs({**request(1, 2).inputs, "len": np.zeros((1, 1), np.int32)})


def test_models_without_variable_inputs_have_no_padding():
    c = mc.ModelConfig(name="m", max_batch_size=8)
    c.input.add(name="x", data_type=mc.TYPE_FP32, dims=[-1])
    c.output.add(name="y", data_type=mc.TYPE_FP32, dims=[-1])
    assert Padding.from_config(c) is None
    _, key_a = Signature.from_config(c).check_inputs({"x": np.zeros((1, 2), np.float32)})
    _, key_b = Signature.from_config(c).check_inputs({"x": np.zeros((1, 3), np.float32)})
    assert key_a != key_b  # as before: different shapes never join


@pytest.mark.parametrize("change, words", [
    (lambda c: c.input[0].ClearField("dims") or c.input[0].dims.extend([4, 2]), "needs a -1 in dims"),
    (lambda c: setattr(c.input[0], "lengths_input", "nope"), "declares no such input"),
    (lambda c: c.input[2].dims.append(3), "must have dims \\[1\\]"),
    (lambda c: setattr(c, "max_batch_size", 0), "needs max_batch_size > 0"),
    (lambda c: setattr(c.input[1], "variable_length", False) or setattr(c.input[1], "padding_value", 3),
     "need variable_length"),
    (lambda c: c.output[1].ClearField("dims") or setattr(c.output[1], "variable_length", True), "needs a -1"),
])
def test_inconsistent_padding_configs_are_refused(change, words):
    c = config()
    change(c)
    with pytest.raises(ConfigError, match=words):
        Padding.from_config(c)


def test_a_length_that_is_not_the_first_dim_is_padded_too():
    c = mc.ModelConfig(name="m", max_batch_size=8)
    c.input.add(name="x", data_type=mc.TYPE_FP32, dims=[2, -1], variable_length=True, padding_value=-1)
    c.output.add(name="y", data_type=mc.TYPE_FP32, dims=[2])
    padding = Padding.from_config(c)
    short = InferRequest("m", {"x": np.arange(4, dtype=np.float32).reshape(2, 2, 1)}, 2, (), length=1)
    long = InferRequest("m", {"x": np.arange(10, 16, dtype=np.float32).reshape(1, 2, 3)}, 1, (), length=3)
    inputs, count = PaddedAssembler(padding).gather(Batch([short, long], True))
    assert inputs["x"].shape == (3, 2, 3)
    np.testing.assert_array_equal(inputs["x"][:2, :, :1], short.inputs["x"])
    assert (inputs["x"][:2, :, 1:] == -1).all()
    np.testing.assert_array_equal(inputs["x"][2], long.inputs["x"][0])
    assert (count.padded, count.computed) == (4, 9)
