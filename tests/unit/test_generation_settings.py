"""The `generation` config section: defaults, refusals, and how the KV pool is sized."""

from __future__ import annotations

import re

import pytest

from protos import model_config_pb2 as mc
from server.backends.llm.engine import EngineSettings
from server.errors import ConfigError
from server.runners.settings import generation_settings
from server.scheduling.sequence import DEFAULT_MAX_TOKENS


def test_defaults_fill_what_the_config_leaves_out():
    g = mc.ModelGeneration(block_size=8, max_num_seqs=4)
    engine = EngineSettings.from_config(g, "cfg")
    scheduling = generation_settings(g, max_model_len=128, num_kv_blocks=50).continuous
    assert (engine.block_size, scheduling.max_num_seqs, scheduling.max_num_batched_tokens) == (8, 4, 2048)
    assert engine.gpu_memory_utilization == pytest.approx(0.9) and engine.kv_cache_memory_mb == 0


def test_max_tokens_has_one_default_and_the_admission_margin_is_a_share_of_the_pool():
    assert generation_settings(mc.ModelGeneration(), 128, 50).default_max_tokens == DEFAULT_MAX_TOKENS
    assert generation_settings(mc.ModelGeneration(default_max_tokens=7), 128, 50).default_max_tokens == 7
    assert generation_settings(mc.ModelGeneration(), 128, 50).continuous.admit_margin_blocks == 1
    assert generation_settings(mc.ModelGeneration(), 128, 1000).continuous.admit_margin_blocks == 10


@pytest.mark.parametrize("field, value, words", [
    ("dtype", "int4", "generation.dtype"), ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("block_size", 4096, "block_size"),
])
def test_bad_values_are_refused_naming_the_field(field, value, words):
    g = mc.ModelGeneration(**{field: value})
    with pytest.raises(ConfigError, match=words):
        EngineSettings.from_config(g, "cfg")


def test_the_step_time_target_is_off_unless_set_and_reaches_the_scheduler():
    off = generation_settings(mc.ModelGeneration(), 128, 50).continuous
    assert (off.max_step_ms, off.min_prefill_tokens) == (0.0, 32)
    on = generation_settings(mc.ModelGeneration(max_step_ms=45.5, min_prefill_tokens=8), 128, 50).continuous
    assert (on.max_step_ms, on.min_prefill_tokens) == (45.5, 8)


def test_the_default_prefill_floor_yields_to_a_smaller_step():
    small = generation_settings(mc.ModelGeneration(max_num_batched_tokens=12), 128, 50).continuous
    assert (small.max_num_batched_tokens, small.min_prefill_tokens) == (12, 12)


@pytest.mark.parametrize("fields, words", [
    ({"max_step_ms": -1}, "'generation.max_step_ms' must be a number of milliseconds >= 0"),
    ({"max_step_ms": float("nan")}, "'generation.max_step_ms' must be"),
    ({"max_step_ms": float("inf")}, "'generation.max_step_ms' must be"),
    ({"min_prefill_tokens": 4096}, "'generation.min_prefill_tokens' is 4096, more than generation.max_num_batched_tokens (2048)"),
])
def test_bad_step_targets_are_refused_naming_the_field_and_value(fields, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        generation_settings(mc.ModelGeneration(**fields), 128, 50, source="m")
