"""Build the right runner for a loaded model version: the one place a model's kind is decided.

app.py hands a `RunnerFactory` to the registry, which calls it for every version it loads and holds
what comes back only as a `Runner`. A new model kind is one more branch here and one more runner.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from protos import model_config_pb2 as mc
from server.backends import EMBEDDING, GENERATION, python_based
from server.defaults import DEFAULT_SEQUENCE_IDLE_US, MAX_QUEUED_REQUESTS
from server.errors import ConfigError
from server.observability.custom_metrics import CustomMetrics
from server.observability.generation_metrics import GenerationFamilies, GenerationStats
from server.observability.loop_load import LoopLoad
from server.observability.metrics import Histograms, ModelProcessRestarts, ModelStats
from server.response_cache import ResponseCache
from server.repository.ensemble_config import step_order
from server.runners.base import Runner
from server.runners.batch import ModelRunner
from server.runners.decoupled import DecoupledRunner, StreamBatching
from server.runners.sequence import SequenceRunner
from server.runners.sequence_inputs import SequenceInputs
from server.runners.embedding import EmbeddingRunner
from server.runners.ensemble import EnsembleRunner, LateLookup
from server.runners.generation import GenerationRunner
from server.runners.model_calls import LateControl, ModelCalls
from server.runners.settings import (batching_settings, binpack_settings, generation_settings, instance_needs, request_queue,
                                     speculative_settings)
from server.scheduling.base import Scheduler
from server.scheduling.binpack import BinPackBatcher
from server.scheduling.budget import ByteBudget
from server.scheduling.rate_limiter import Need, RateLimiter
from server.scheduling.continuous import ContinuousScheduler
from server.scheduling.dynamic import DynamicBatcher
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence_slots import SequenceSlots
from server.scheduling.speculative import Speculator
from server.worker import Worker

if TYPE_CHECKING:
    from server.repository.loader import LoadedVersion

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerFactory:
    """What every runner shares (metric families, the server-wide queue caps); called once per version."""

    histograms: Histograms | None = None
    generation_families: GenerationFamilies | None = None
    max_queued: int = MAX_QUEUED_REQUESTS
    server_budget: ByteBudget = field(default_factory=lambda: ByteBudget(0, "the server"))
    max_model_queued_bytes: int = 0  # per version, within the server's budget (0: only the server's)
    models: LateLookup = field(default_factory=LateLookup)  # the registry's lookup, for ensemble steps
    loop_load: LoopLoad | None = None  # the event loop's busy share, which adaptive windows take into account
    response_cache: ResponseCache | None = None  # the server's (--cache-config), for models that enable it
    control: LateControl = field(default_factory=LateControl)  # the server's model control, for pb_utils.load_model
    restarts: ModelProcessRestarts | None = None  # Python model processes started again after dying
    custom_metrics: CustomMetrics | None = None  # pb_utils.MetricFamily values, shown on /metrics
    rate_limiter: RateLimiter | None = None  # --rate-limit execution_count: instance_group rate_limiter applied

    def __call__(self, name: str, entry: LoadedVersion) -> Runner:
        """A runner for `entry`, not started; raises ConfigError if the version cannot be served as configured."""
        stats = ModelStats(name, entry.version, self.histograms)
        self._bind_calls(entry)
        cache = self._cache_for(name, entry.config)
        stats.cached = cache is not None
        budget = ByteBudget(self.max_model_queued_bytes, f"model '{name}' version {entry.version}", self.server_budget)
        if entry.config.platform == "ensemble":
            return EnsembleRunner(name, entry.version, entry.config, step_order(entry.config, name), self.models, stats,
                                  cache)
        if entry.config.backend in GENERATION:
            gen_stats = GenerationStats(self.generation_families, name, entry.version)
            return generation_runner(name, entry, stats, gen_stats, budget)
        if entry.config.backend == EMBEDDING:
            return embedding_runner(name, entry, stats, budget, self.max_queued, self.loop_load)
        if entry.config.model_transaction_policy.decoupled:
            return decoupled_runner(name, entry, stats, budget)
        if entry.config.HasField("sequence_batching"):
            return sequence_runner(name, entry, stats, budget, self.max_queued, self.loop_load)
        workers = [Worker(b, entry.signature, f"{name}-{entry.version}-{i}") for i, b in enumerate(entry.backends)]
        return ModelRunner(name, entry.version, build_scheduler(entry.config, self.max_queued), workers, stats,
                           preserve_ordering=entry.config.dynamic_batching.preserve_ordering, budget=budget,
                           loop_load=self.loop_load, cache=cache, limits=self._limits(name, entry))

    def _limits(self, name: str, entry: LoadedVersion) -> tuple[RateLimiter, list[Need]] | None:
        """Each instance's rate_limiter need, with --rate-limit execution_count; None without it (Triton's
        default: the limiter is off and the setting has no effect)."""
        declared = any(g.HasField("rate_limiter") for g in entry.config.instance_group)
        if self.rate_limiter is None:
            if declared:
                log.info("model '%s': instance_group rate_limiter is not applied: the server runs without "
                         "--rate-limit execution_count", name)
            return None
        needs = instance_needs(entry.config, [getattr(b, "instance_group", 0) for b in entry.backends],
                               [str(b.device) for b in entry.backends])
        self.rate_limiter.register(needs)
        return self.rate_limiter, needs

    def model_calls(self) -> ModelCalls:
        """What Python model processes reach the server through (BLS, model control, metrics); on the loop."""
        return ModelCalls(asyncio.get_running_loop(), self.models, self.control, self.restarts, self.custom_metrics)

    def _bind_calls(self, entry: LoadedVersion) -> None:
        """Instances the loader bound already (it does, before initialize) keep theirs."""
        if not any(getattr(b, "calls", False) is None for b in entry.backends):
            return
        calls = self.model_calls()
        for backend in entry.backends:
            if getattr(backend, "calls", False) is None:
                backend.calls = calls

    def _cache_for(self, name: str, config: mc.ModelConfig) -> ResponseCache | None:
        """The response cache, for a batched model or an ensemble whose config enables it; ConfigError for a
        kind whose answers are not one response per request or depend on state (Triton refuses those too)."""
        if not config.response_cache.enable:
            return None
        kind = ("a generation model" if config.backend in GENERATION
                else "a decoupled model" if config.model_transaction_policy.decoupled
                else "a sequence (stateful) model" if config.HasField("sequence_batching") else None)
        if kind is not None:
            raise ConfigError(f"model '{name}': response_cache.enable is not supported for {kind} (its answers "
                              "depend on more than the request's inputs, or are not one response per request)")
        if self.response_cache is None:
            log.warning("model '%s' enables response_cache, but the server has no cache: start it with "
                        "--cache-config local,size=BYTES to use it", name)
        return self.response_cache


def build_scheduler(config: mc.ModelConfig, max_queued: int = MAX_QUEUED_REQUESTS) -> Scheduler:
    """The model's batching policy: cost buckets when `binpack_batching` is present, else dynamic batching."""
    settings, queue = batching_settings(config), request_queue(config, max_queued)
    if config.HasField("binpack_batching"):
        return BinPackBatcher(settings, binpack_settings(config), queue)
    return DynamicBatcher(settings, queue)


def embedding_runner(name: str, entry: LoadedVersion, stats: ModelStats, budget: ByteBudget, max_queued: int,
                     loop_load: LoopLoad | None = None) -> EmbeddingRunner:
    """Texts batched by token count: each text of a request queues on its own (runners/embedding.py)."""
    config = entry.config
    if config.model_transaction_policy.decoupled or config.HasField("sequence_batching"):
        raise ConfigError(f"model '{name}': an embedding model answers each request once and keeps no state; "
                          "remove model_transaction_policy.decoupled and sequence_batching")
    workers = [Worker(b, entry.signature, f"{name}-{entry.version}-{i}") for i, b in enumerate(entry.backends)]
    return EmbeddingRunner(name, entry.version, build_scheduler(config, max_queued), workers, stats, budget=budget,
                           loop_load=loop_load)


def sequence_runner(name: str, entry: LoadedVersion, stats: ModelStats, budget: ByteBudget,
                    max_queued: int, loop_load: LoopLoad | None = None) -> SequenceRunner:
    """A batching runner over the model's instances (which see controls and state), behind the sequence runner."""
    config, sb = entry.config, entry.config.sequence_batching
    extra = SequenceInputs.from_config(config, f"model '{name}'")
    signature = extra.worker_signature(entry.signature)
    workers = [Worker(b, signature, f"{name}-{entry.version}-{i}") for i, b in enumerate(entry.backends)]
    batching = copy.deepcopy(config)  # the strategy's window and sizes, as dynamic batching reads them
    strategy = sb.oldest if sb.WhichOneof("strategy_choice") == "oldest" else sb.direct
    batching.dynamic_batching.max_queue_delay_microseconds = strategy.max_queue_delay_microseconds
    if sb.WhichOneof("strategy_choice") == "oldest":
        batching.dynamic_batching.preferred_batch_size.extend(sb.oldest.preferred_batch_size)
        capacity = sb.oldest.max_candidate_sequences
    else:  # direct: one slot per batch row of every instance
        capacity = max(config.max_batch_size, 1) * len(workers)
    inner = ModelRunner(name, entry.version, build_scheduler(batching, max_queued), workers, stats, budget=budget,
                        loop_load=loop_load)
    return SequenceRunner(inner, extra, SequenceSlots(capacity, idle_ns(sb)), iterative=_iterative(name, config))


def idle_ns(sb: mc.ModelSequenceBatching) -> int:
    """How long a sequence may go without a request before it is released: `max_sequence_idle_microseconds`,
    or Triton's default of one second when it is unset or 0 (a client that vanished mid-sequence must not
    hold a slot, or the model's state for it, for ever)."""
    return (sb.max_sequence_idle_microseconds or DEFAULT_SEQUENCE_IDLE_US) * 1000


def _iterative(name: str, config: mc.ModelConfig) -> bool:
    """`sequence_batching { iterative_sequence: true }`: requests the model reschedules run again. Only
    Python models can reschedule (pb_utils' set_release_flags); for any other the setting would do
    nothing, so it is refused rather than ignored."""
    if not config.sequence_batching.iterative_sequence:
        return False
    if not python_based.is_python(config):
        raise ConfigError(f"model '{name}': sequence_batching.iterative_sequence needs a model that reschedules "
                          f"its requests (the python backend's set_release_flags), not backend {config.backend!r}")
    return True


_DECOUPLED_QUEUE_FIELDS = ("max_queue_delay_microseconds", "preserve_ordering", "default_queue_policy", "priority_levels",
                           "default_priority_level", "priority_queue_policy")


def decoupled_runner(name: str, entry: LoadedVersion, stats: ModelStats, budget: ByteBudget) -> DecoupledRunner:
    if not python_based.is_python(entry.config):
        raise ConfigError(f"model '{name}': model_transaction_policy.decoupled needs the python backend "
                          f"(a model.py whose execute yields responses), not {entry.config.backend!r}")
    config = entry.config
    iterative = _iterative(name, config)
    batching, sequence = StreamBatching(), None
    if config.HasField("sequence_batching") and not iterative:
        sequence, batching = _decoupled_sequences(name, config)
    elif config.max_batch_size > 0 and config.HasField("dynamic_batching") and not iterative:
        db = config.dynamic_batching
        batching = StreamBatching(config.max_batch_size, db.max_queue_delay_microseconds * 1000,
                                  request_queue(config, 0))
        unused = [f.name for f, _ in db.ListFields() if f.name not in _DECOUPLED_QUEUE_FIELDS]
        if unused:
            log.warning("model '%s': a decoupled model's queue takes max_batch_size, max_queue_delay_microseconds, "
                        "priority levels and queue policies; dynamic_batching %s does not apply to it",
                        name, ", ".join(unused))
    slots = SequenceSlots(0, idle_ns(config.sequence_batching)) if sequence is not None else None
    return DecoupledRunner(name, entry.version, entry.backends, entry.signature, stats, budget, iterative, batching,
                           sequence, slots)


def _decoupled_sequences(name: str, config: mc.ModelConfig) -> tuple[SequenceInputs, StreamBatching]:
    """A stateful decoupled model: its control inputs, and its batches (the sequence batcher's: one request
    per sequence, up to max_batch_size, within the strategy's max_queue_delay)."""
    sb = config.sequence_batching
    sequence = SequenceInputs.from_config(config, f"model '{name}'")
    if sequence.states:
        raise ConfigError(f"model '{name}': sequence_batching.state (implicit state) is not supported for a decoupled "
                          "model (which of its responses would carry the state?); keep the state in the model's "
                          "instance, by correlation id")
    strategy = sb.oldest if sb.WhichOneof("strategy_choice") == "oldest" else sb.direct
    unused = [f"sequence_batching.{f.name}" for f, _ in sb.ListFields()
              if f.name not in ("control_input", "direct", "oldest", "max_sequence_idle_microseconds")]
    unused += [f"sequence_batching.oldest.{f.name}" for f, _ in sb.oldest.ListFields() if f.name != "max_queue_delay_microseconds"]
    if unused:
        log.warning("model '%s': a decoupled sequence model's requests run on their sequence's instance, one per "
                    "sequence per execute, with no limit on live sequences; %s does not apply to it", name,
                    ", ".join(unused))
    return sequence, StreamBatching(max(config.max_batch_size, 0), strategy.max_queue_delay_microseconds * 1000)


def generation_runner(name: str, entry: LoadedVersion, stats: ModelStats, gen_stats: GenerationStats,
                      budget: ByteBudget | None = None) -> GenerationRunner:
    if len(entry.backends) != 1:
        raise ConfigError(f"model '{name}': a generation model runs exactly one instance (instance_group count 1)")
    backend = entry.backends[0]
    settings = generation_settings(entry.config.generation, backend.max_model_len, backend.num_kv_blocks,
                                   frozenset(backend.eos_token_ids), source=name)
    pool = KVBlockPool(backend.num_kv_blocks, backend.settings.block_size, settings.enable_prefix_caching,
                       backend.released_window)
    speculative = speculative_settings(entry.config)
    continuous = settings.continuous
    if backend.loras is not None:  # as many adapters run at once as the engine holds
        continuous = dataclasses.replace(continuous, max_loras=backend.loras.max_loras)
    scheduler = ContinuousScheduler(continuous, pool, Speculator(speculative) if speculative else None)
    return GenerationRunner(name, entry.version, backend, scheduler, stats, gen_stats, settings.default_max_tokens,
                            budget)
