"""The `generation` config section: defaults, refusals, and how the KV pool is sized."""

from __future__ import annotations

import pytest

from protos import model_config_pb2 as mc
from server.backends.llm.engine import GenerationSettings
from server.errors import ConfigError


def test_defaults_fill_what_the_config_leaves_out():
    g = mc.ModelGeneration(block_size=8, max_num_seqs=4)
    settings = GenerationSettings.from_config(g, "cfg")
    assert (settings.block_size, settings.max_num_seqs, settings.max_num_batched_tokens) == (8, 4, 2048)
    assert settings.gpu_memory_utilization == pytest.approx(0.9) and settings.kv_cache_memory_mb == 0


@pytest.mark.parametrize("field, value, words", [
    ("dtype", "int4", "generation.dtype"), ("gpu_memory_utilization", 1.5, "gpu_memory_utilization"),
    ("block_size", 4096, "block_size"),
])
def test_bad_values_are_refused_naming_the_field(field, value, words):
    g = mc.ModelGeneration(**{field: value})
    with pytest.raises(ConfigError, match=words):
        GenerationSettings.from_config(g, "cfg")
