"""Warmup sample tensors built from a config's model_warmup inputs (server/repository/warmup.py)."""

from __future__ import annotations

import numpy as np
import pytest

from protos import model_config_pb2 as mc
from server.errors import ConfigError
from server.repository.warmup import _tensor


def spec(**fields) -> mc.ModelWarmup.Input:
    return mc.ModelWarmup.Input(**{"data_type": mc.TYPE_FP32, "dims": [3], **fields})


def test_zero_random_and_bytes_samples_take_the_batch_and_the_dims(tmp_path):
    rng = np.random.default_rng(0)
    zeros = _tensor("x", spec(zero_data=True), (2,), tmp_path, rng)
    assert zeros.shape == (2, 3) and zeros.dtype == np.float32 and not zeros.any()
    noise = _tensor("x", spec(random_data=True), (2,), tmp_path, rng)
    assert noise.dtype == np.float32 and noise.any() and ((noise >= 0) & (noise < 1)).all()
    ids = _tensor("x", spec(data_type=mc.TYPE_INT64, random_data=True), (), tmp_path, rng)
    assert ids.shape == (3,) and ids.dtype == np.int64
    text = _tensor("x", spec(data_type=mc.TYPE_STRING, zero_data=True), (1,), tmp_path, rng)
    assert text.tolist() == [[b"", b"", b""]]


def test_a_file_sample_is_raw_bytes_of_exactly_its_shape(tmp_path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "x.bin").write_bytes(np.arange(3, dtype=np.float32).tobytes())
    assert _tensor("x", spec(input_data_file="x.bin"), (1,), tmp_path, None).tolist() == [[0, 1, 2]]
    with pytest.raises(ConfigError, match="needs 24 bytes"):
        _tensor("x", spec(input_data_file="x.bin"), (2,), tmp_path, None)


def test_a_sample_with_a_variable_dim_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="must be sizes"):
        _tensor("x", spec(dims=[-1], zero_data=True), (1,), tmp_path, None)


@pytest.mark.parametrize("config, words", [
    (mc.ModelConfig(backend="llm"), "the llm backend"),
    (mc.ModelConfig(backend="python", model_transaction_policy=mc.ModelTransactionPolicy(decoupled=True)), "decoupled"),
    (mc.ModelConfig(backend="python", sequence_batching=mc.ModelSequenceBatching()), "sequence model"),
])
def test_kinds_whose_executions_are_not_plain_batches_refuse_warmup_samples(config, words):
    from server import backends
    from server.repository.loader import _check_warmable

    with pytest.raises(ConfigError, match=words):
        _check_warmable(config, backends.backend_class(config.backend), "m/config.yaml")
