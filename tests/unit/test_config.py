"""Config files: YAML and pbtxt give one message; errors name the file and the field."""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from server.errors import ConfigError
from server.repository import config as config_io
from server.repository.loader import select_versions
from server.runners.factory import build_scheduler

YAML = """
max_batch_size: 8
input: [{name: x, data_type: TYPE_FP32, dims: [-1, 4]}]
output: [{name: y, data_type: TYPE_FP32, dims: [4]}]
dynamic_batching:
  preferred_batch_size: [4, 8]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 2
  priority_queue_policy: {1: {max_queue_size: 3}}
instance_group: [{count: 2, kind: KIND_CPU}]
"""
PBTXT = """
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  priority_levels: 2
  default_priority_level: 2
  priority_queue_policy { key: 1 value: { max_queue_size: 3 } }
}
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def write(tmp_path, name, text):
    folder = tmp_path / "m"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return folder


def test_yaml_and_pbtxt_parse_to_the_same_message(tmp_path):
    a = config_io.read_config(write(tmp_path / "a", "config.yaml", YAML))
    b = config_io.read_config(write(tmp_path / "b", "config.pbtxt", PBTXT))
    assert a == b and a.name == "m" and a.dynamic_batching.priority_queue_policy[1].max_queue_size == 3


def test_scheduler_built_from_config(tmp_path):
    config = config_io.read_config(write(tmp_path, "config.yaml", YAML))
    config_io.validate(config, "config.yaml")
    scheduler = build_scheduler(config)
    assert scheduler.settings.preferred_batch_sizes == (4, 8)
    assert scheduler.settings.max_queue_delay_ns == 100_000
    assert scheduler.queue.default_level == 2 and scheduler.queue.policy(1).max_queue_size == 3


@pytest.mark.parametrize("name, text, words", [
    ("config.yaml", "max_batch_size: 4\nmax_batch: 2\n", ["config.yaml", "max_batch"]),
    ("config.yaml", "max_batch_size: many\n", ["config.yaml", "max_batch_size"]),
    ("config.pbtxt", "max_batch_size: 4\ninput [ { nme: \"x\" } ]\n", ["m/config.pbtxt", "line 2, column 11", "did you mean 'name'"]),
    ("config.yaml", "name: other\n", ["'name'", "other"]),
])
def test_parse_errors_name_file_and_field(tmp_path, name, text, words):
    with pytest.raises(ConfigError) as info:
        config_io.read_config(write(tmp_path, name, text))
    for word in words:
        assert word in info.value.message


@pytest.mark.parametrize("mutate, field", [
    (lambda c: c.input[0].ClearField("dims"), "input[0].dims"),
    (lambda c: setattr(c.input[0], "data_type", mc.TYPE_INVALID), "input[0].data_type"),
    (lambda c: c.dynamic_batching.preferred_batch_size.append(16), "preferred_batch_size"),
    (lambda c: c.input.add(name="x", data_type=mc.TYPE_FP32, dims=[1]), "input[1].name"),
    (lambda c: c.ensemble_scheduling.SetInParent(), "ensemble_scheduling"),  # without platform: "ensemble"
])
def test_validation_names_the_field(tmp_path, mutate, field):
    config = config_io.read_config(write(tmp_path, "config.yaml", YAML))
    mutate(config)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        config_io.validate(config, "config.yaml")


def test_version_policy_selection():
    policy = mc.ModelVersionPolicy()
    assert select_versions(policy, [1, 3, 2]) == [3]
    policy.latest.num_versions = 2
    assert select_versions(policy, [1, 3, 2]) == [2, 3]
    policy.all.SetInParent()
    assert select_versions(policy, [2, 1]) == [1, 2]
    policy.specific.versions.extend([1, 4])
    assert select_versions(policy, [1, 2]) == [1, 4]  # 4 is reported missing by the loader


def test_reshape_must_hold_as_many_elements_as_the_dims(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.pbtxt").write_text('input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, 4 ] reshape { shape: [ 1, 13 ] } } ]\n'
                                        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n')
    with pytest.raises(ConfigError, match=r"input\[0\].reshape.*13 elements but dims \[3, 4\] hold 12"):
        config_io.validate(config_io.read_config(model), "m/config.pbtxt")


def test_triton_settings_ferry_does_not_apply_are_named_at_load(tmp_path, caplog):
    unapplied = YAML + ("optimization: {execution_accelerators: {gpu_execution_accelerator: [{name: tensorrt}]}}\n"
                        "batch_input: [{kind: BATCH_ELEMENT_COUNT, target_name: [n], data_type: TYPE_FP32}]\n")
    config = config_io.read_config(write(tmp_path, "config.yaml", unapplied))
    with caplog.at_level("WARNING", logger="server.repository.config"):
        config_io.validate(config, "m/config.yaml")
    assert "m/config.yaml: optimization, batch_input: Triton settings that Ferry does not apply yet" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="server.repository.config"):
        config_io.validate(config_io.read_config(write(tmp_path, "config.yaml", YAML)), "m/config.yaml")
    assert "does not apply" not in caplog.text  # a config without them loads quietly
