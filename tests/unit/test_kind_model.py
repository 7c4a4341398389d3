"""KIND_MODEL (Triton's "the model places itself", as its vLLM folders write): `count` instances, not one per GPU."""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from server.backends.base import Device
from server.repository.loader import _placed


def on_machine(gpus: int):
    class Machine:  # only the loader's question to a backend class: how many CUDA devices it can use
        @classmethod
        def cuda_devices(cls) -> int:
            return gpus
        name = "llm"
    return Machine


@pytest.mark.parametrize("gpus, expected", [(0, [Device("cpu")]), (2, [Device("cuda", 0)])])
def test_kind_model_places_count_instances_once_whatever_the_gpus(gpus, expected):
    config = mc.ModelConfig()
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_MODEL)
    assert [d for d, _, _ in _placed(config, on_machine(gpus))] == expected


def test_kind_auto_still_places_count_on_every_gpu():
    config = mc.ModelConfig()
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    assert _placed(config, on_machine(2)) == [(Device("cuda", 0), 0, "_0_0"), (Device("cuda", 1), 0, "_0_1")]


def test_instances_are_named_as_triton_names_them():
    config = mc.ModelConfig(name="m")
    config.instance_group.add(count=2, kind=mc.ModelInstanceGroup.KIND_CPU)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU, name="side")
    assert [(g, n) for _, g, n in _placed(config, on_machine(0))] == [(0, "m_0_0"), (0, "m_0_1"), (1, "side_0")]
