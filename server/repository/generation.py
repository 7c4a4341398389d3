"""Assemble a loaded `backend: llm` model into its continuous-batching runner."""

from __future__ import annotations

from server.errors import ConfigError
from server.generation_metrics import GenerationStats
from server.generation_runner import GenerationRunner
from server.metrics import ModelStats
from server.repository.loader import LoadedVersion
from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool


def build_runner(name: str, entry: LoadedVersion, stats: ModelStats, gen_stats: GenerationStats) -> GenerationRunner:
    if len(entry.backends) != 1:
        raise ConfigError(f"model '{name}': a generation model runs exactly one instance (instance_group count 1)")
    backend = entry.backends[0]
    settings = backend.settings
    pool = KVBlockPool(backend.num_kv_blocks, settings.block_size)
    scheduler = ContinuousScheduler(ContinuousSettings(
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=backend.max_model_len, max_waiting=settings.max_waiting,
        admit_margin_blocks=max(1, backend.num_kv_blocks // 100),
    ), pool)
    return GenerationRunner(name, entry.version, backend, scheduler, stats, gen_stats)
