"""ModelConfig -> the settings each policy runs with, in one place; each default is defined once.

The policies in scheduling/ take plain dataclasses and never see protobuf; this module reads the
config once at load. Defaults live on those dataclasses (or, for max_tokens, in sequence.py) and
a config's 0 or absent field means "use it". Backend-specific knobs (ONNX Runtime options, the LLM
engine's KV sizing and dtype) stay with their backend, which reads them when it loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protos import model_config_pb2 as mc
from server.repository.config import field_error
from server.scheduling.binpack import BinPackSettings
from server.scheduling.continuous import ContinuousSettings
from server.scheduling.dynamic import BatchingSettings
from server.scheduling.queue import DELAY, REJECT, QueuePolicy, RequestQueue
from server.scheduling.rate_limiter import GLOBAL, Need
from server.scheduling.sequence import DEFAULT_MAX_TOKENS
from server.scheduling.speculative import SpeculativeSettings
from server.scheduling.step_budget import AUTO

# Admission keeps one KV block in this many free while sequences run (at least one), so a sequence
# resumed after a preemption is not evicted again at once.
ADMIT_MARGIN_PER_BLOCKS = 100


def batching_settings(config: mc.ModelConfig) -> BatchingSettings:
    db = config.dynamic_batching
    return BatchingSettings(
        max_batch_size=config.max_batch_size,
        preferred_batch_sizes=tuple(db.preferred_batch_size),
        max_queue_delay_ns=db.max_queue_delay_microseconds * 1000,
        join=config.HasField("dynamic_batching"),
        latency_target_ns=int(db.latency_target_ms * 1_000_000),
    )


def queue_policy(policy: mc.ModelQueuePolicy) -> QueuePolicy:
    action = DELAY if policy.timeout_action == mc.ModelQueuePolicy.DELAY else REJECT
    return QueuePolicy(action, policy.default_timeout_microseconds, policy.allow_timeout_override, policy.max_queue_size)


def request_queue(config: mc.ModelConfig, max_queued: int) -> RequestQueue:
    """Priority levels and queue policies, read from `dynamic_batching` for every batching policy."""
    db = config.dynamic_batching
    levels = max(int(db.priority_levels), 1)
    default = queue_policy(db.default_queue_policy)
    policies = [queue_policy(db.priority_queue_policy[i]) if i in db.priority_queue_policy else default
                for i in range(1, levels + 1)]
    default_level = int(db.default_priority_level) or 1
    if default_level > levels:
        raise field_error(config.name, "dynamic_batching.default_priority_level",
                          f"{default_level} exceeds priority_levels {levels}")
    return RequestQueue(policies, default_level, max_queued)


def binpack_settings(config: mc.ModelConfig) -> BinPackSettings:
    bp, defaults = config.binpack_batching, BinPackSettings()
    bounds = tuple(bp.bucket_boundaries)
    if config.max_batch_size <= 0:
        raise field_error(config.name, "binpack_batching", f"needs max_batch_size > 0, got {config.max_batch_size}")
    if any(b <= 0 for b in bounds) or any(hi <= lo for lo, hi in zip(bounds, bounds[1:])):
        raise field_error(config.name, "binpack_batching.bucket_boundaries",
                          f"must be positive and strictly ascending, got {list(bounds)}")
    for name in ("max_batch_cost", "stretch", "min_batch_cost"):
        if getattr(bp, name) < 0:
            raise field_error(config.name, f"binpack_batching.{name}", f"must be >= 0, got {getattr(bp, name)}")
    return BinPackSettings(
        quadratic=bp.cost_model == mc.ModelBinPacking.QUADRATIC,
        boundaries=bounds,
        num_buckets=bp.num_buckets or defaults.num_buckets,
        learning_window=bp.learning_window or defaults.learning_window,
        max_batch_cost=bp.max_batch_cost,
        stretch=bp.stretch or defaults.stretch,
        min_batch_cost=bp.min_batch_cost,
    )


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """What the generation runner needs from the `generation` section: its scheduler's settings and
    the max_tokens a request gets when it names none."""

    continuous: ContinuousSettings
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    enable_prefix_caching: bool = True  # share KV blocks of common prompt prefixes (scheduling/prefix_cache.py)


def generation_settings(g: mc.ModelGeneration, max_model_len: int, num_kv_blocks: int,
                        eos_token_ids: frozenset[int] = frozenset(), source: str = "model") -> GenerationSettings:
    """`max_model_len`, `num_kv_blocks`, `eos_token_ids`: what the loaded engine found (they depend on
    the model's files and the device's memory, so only the backend knows them)."""
    defaults = ContinuousSettings()
    batched = g.max_num_batched_tokens or defaults.max_num_batched_tokens
    continuous = ContinuousSettings(
        max_num_seqs=g.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=batched,
        max_model_len=max_model_len,
        max_waiting=g.max_waiting or defaults.max_waiting,
        admit_margin_blocks=max(1, num_kv_blocks // ADMIT_MARGIN_PER_BLOCKS),
        eos_token_ids=frozenset(eos_token_ids),
        max_step_ms=g.max_step_ms,
        auto_step_target=0.0 if g.max_step_ms else AUTO,  # no target of its own: one sized from measured cost
        # the default yields to a smaller step; only a value the config sets can be refused
        min_prefill_tokens=g.min_prefill_tokens or min(defaults.min_prefill_tokens, batched),
    )
    _check_step_target(continuous, source)
    caching = g.enable_prefix_caching if g.HasField("enable_prefix_caching") else GenerationSettings.enable_prefix_caching
    return GenerationSettings(continuous, g.default_max_tokens or DEFAULT_MAX_TOKENS, caching)


def _check_step_target(s: ContinuousSettings, source: str) -> None:
    if not math.isfinite(s.max_step_ms) or s.max_step_ms < 0:
        raise field_error(source, "generation.max_step_ms",
                          f"must be a number of milliseconds >= 0 (0: no target), got {s.max_step_ms}")
    if s.min_prefill_tokens > s.max_num_batched_tokens:
        raise field_error(source, "generation.min_prefill_tokens",
                          f"is {s.min_prefill_tokens}, more than generation.max_num_batched_tokens "
                          f"({s.max_num_batched_tokens}) allows in one step")


def speculative_settings(config: mc.ModelConfig) -> SpeculativeSettings | None:
    """`generation.speculative`, checked; None when absent or its method is empty (off)."""
    spec = config.generation.speculative
    if not spec.method:
        if spec.num_speculative_tokens:
            raise field_error(config.name, "generation.speculative.method", "is empty; set it to \"ngram\"")
        return None
    if spec.method != "ngram":
        raise field_error(config.name, "generation.speculative.method",
                          f"is {spec.method!r}; Ferry implements \"ngram\" (prompt lookup)")
    if spec.num_speculative_tokens < 1:
        raise field_error(config.name, "generation.speculative.num_speculative_tokens", "must be at least 1 with method ngram")
    defaults = SpeculativeSettings(1)
    lookup_max = spec.prompt_lookup_max or max(defaults.prompt_lookup_max, spec.prompt_lookup_min)
    lookup_min = spec.prompt_lookup_min or min(defaults.prompt_lookup_min, lookup_max)
    if lookup_min > lookup_max:
        raise field_error(config.name, "generation.speculative.prompt_lookup_min",
                          f"{lookup_min} exceeds prompt_lookup_max {lookup_max}")
    return SpeculativeSettings(spec.num_speculative_tokens, lookup_max, lookup_min)


def instance_needs(config: mc.ModelConfig, group_of_instance: list[int], device_of_instance: list[str]) -> list[Need]:
    """Each instance's need, from its instance group's rate_limiter (none declared: an empty need)."""
    needs = []
    for group_index, device in zip(group_of_instance, device_of_instance):
        group = config.instance_group[group_index] if group_index < len(config.instance_group) else None
        if group is None or not group.HasField("rate_limiter"):
            needs.append(Need())
            continue
        limiter = group.rate_limiter
        counts = tuple(((r.name, GLOBAL if getattr(r, "global") else device), r.count) for r in limiter.resources)
        needs.append(Need(counts, limiter.priority))
    return needs
