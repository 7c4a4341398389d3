"""The engine one process serves from: metrics registry, byte budgets, response cache, runner factory
and model registry, built one way for `ferry serve` (server/app.py) and `ferry batch` (server/batch/).

Whatever decides how a model runs (queue bounds, byte budgets, the cache, which models load at
start) lives here once, so a request run in-process by `ferry batch` meets the same runners, with the
same limits, as one sent to the server.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, disable_created_metrics

from server.observability.custom_metrics import CustomMetrics
from server.defaults import max_model_queued_bytes, max_queued_bytes
from server.observability.generation_metrics import GenerationFamilies
from server.observability.loop_load import LoopLoad
from server.observability.metrics import CacheCollector, Histograms, ModelProcessRestarts, StatsCollector
from server.doors.model_control import ModelControl
from server.observability.residency_metrics import ResidencyCollector
from server.repository.on_demand import OnDemand
from server.repository.registry import Registry
from server.repository.residency import Residency
from server.response_cache import ResponseCache
from server.runners.factory import RunnerFactory
from server.scheduling.budget import ByteBudget
from server.scheduling.rate_limiter import RateLimiter

if TYPE_CHECKING:
    from server.app import ServerConfig

log = logging.getLogger("ferry")


@dataclass(slots=True)
class Engine:
    prom: CollectorRegistry
    registry: Registry
    loop_load: LoopLoad
    server_budget: ByteBudget
    control: ModelControl  # load / unload as the server's mode allows: for both doors and for model code

    async def load(self, config: ServerConfig) -> None:
        """Load the start-up models: all of them, or with explicit model control only `--load-model`'s."""
        if config.model_control_mode == "on_demand":
            await self.registry.describe_all()  # listed and described now, each loaded by its first request
            return
        explicit = config.model_control_mode == "explicit"
        everything = not explicit or "*" in (config.load_models or ())  # Triton: `--load-model '*'` loads all
        await self.registry.load_all(None if everything else config.load_models or frozenset())

    async def close(self, grace_s: float) -> None:
        """Answer or cut off (UNAVAILABLE) what was admitted within `grace_s`, unload every model."""
        await self.registry.close(grace_s)
        self.loop_load.close()


def byte_budgets(config: ServerConfig) -> tuple[ByteBudget, int]:
    """The server's byte budget and each model version's limit within it, defaults resolved once."""
    server = max_queued_bytes() if config.max_queued_bytes is None else config.max_queued_bytes
    model = max_model_queued_bytes(server) if config.max_model_queued_bytes is None else config.max_model_queued_bytes
    log.info("queued request data bounded at %s for the server, %s per model version",
             _limit(server), _limit(model))
    return ByteBudget(server, "the server"), model


def _limit(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes else "no limit"


def rate_limiter(config: ServerConfig) -> RateLimiter | None:
    if config.rate_limit != "execution_count":
        return None
    limiter = RateLimiter(dict(config.rate_limit_resources))
    log.info("rate limiter on: instances run only while their rate_limiter resources are free (%s)",
             ", ".join(f"{n}:{c}" + (f":{d}" if d else "") for (n, d), c in config.rate_limit_resources) or
             "counts from the largest ask")
    return limiter


def build_engine(config: ServerConfig) -> Engine:
    """Registry, factory and their metrics on the running loop; nothing is loaded yet (`Engine.load`)."""
    disable_created_metrics()  # `_created` series double the page and no dashboard reads them
    prom = CollectorRegistry()
    server_budget, model_bytes = byte_budgets(config)
    loop_load = LoopLoad(asyncio.get_running_loop())  # the front end's load, for adaptive windows and /metrics
    cache = ResponseCache(config.response_cache_bytes) if config.response_cache_bytes else None
    if cache is not None:
        log.info("response cache: %.1f MiB for models with response_cache enabled", cache.capacity / 2**20)
        prom.register(CacheCollector(cache))
    custom_metrics = CustomMetrics()  # what Python models declare with pb_utils.MetricFamily
    prom.register(custom_metrics)
    factory = RunnerFactory(Histograms(prom), GenerationFamilies(prom), config.max_queued_requests, server_budget,
                            model_bytes, loop_load=loop_load, response_cache=cache, restarts=ModelProcessRestarts(prom),
                            custom_metrics=custom_metrics, rate_limiter=rate_limiter(config))
    registry = Registry(config.model_repository, factory, config.default_max_batch_size, config.drain_grace_s,
                        config.backend_directory)
    factory.models.bind(registry.get, registry.lease)  # ensembles and BLS calls find (and load) their models at call time
    control = ModelControl(registry, config.model_control_mode, config.allow_model_upload)
    factory.control.bind(control)  # pb_utils.load_model / unload_model, under the same mode as the doors
    if config.model_control_mode == "on_demand":
        registry.on_demand = OnDemand(registry, Residency(dict(config.model_memory_budget)),
                                      config.model_load_patience_s)
        log.info("on-demand model control: models load on their first request; model memory budget: %s",
                 registry.on_demand.in_use())
    prom.register(ResidencyCollector(registry, registry.on_demand))
    prom.register(StatsCollector(registry.stats, lambda: server_budget.held, lambda: loop_load.busy_ratio))
    return Engine(prom, registry, loop_load, server_budget, control)
