"""/metrics for model memory: each loaded model's footprint, the budget and its use, on-demand loads
and evictions. Read from the registry and the on-demand counts at scrape time (server/repository/on_demand.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from server.repository.on_demand import OnDemand
    from server.repository.registry import Registry


class ResidencyCollector(Collector):
    def __init__(self, registry: Registry, on_demand: OnDemand | None = None):
        self._registry, self._on_demand = registry, on_demand

    def collect(self):
        memory = GaugeMetricFamily("ferry_model_memory_bytes", "Memory a loaded model version holds (measured at its load, "
                                   "or its config's memory_bytes), by place: host or cuda:N", labels=["model", "version", "place"])
        for mv in self._registry.all_versions():
            if mv.ready and mv.footprint is not None:
                for place, nbytes in sorted(mv.footprint.bytes_by_place.items()):
                    memory.add_metric([mv.name, str(mv.version), place], nbytes)
        yield memory
        if self._on_demand is None:
            return
        yield from self._budget()
        yield from self._loads()

    def _budget(self):
        residency = self._on_demand.residency
        budget = GaugeMetricFamily("ferry_model_memory_budget_bytes", "--model-memory-budget, by place", labels=["place"])
        used = GaugeMetricFamily("ferry_model_memory_budget_used_bytes", "Memory the resident models hold, as the budget "
                                 "counts it (their footprints), by place", labels=["place"])
        places = sorted(set(residency.budget) | {"host"})
        for place in places:
            if place in residency.budget:
                budget.add_metric([place], residency.budget[place])
            used.add_metric([place], residency.used(place))
        resident = GaugeMetricFamily("ferry_models_resident", "Models loaded now (on-demand model control)")
        resident.add_metric([], len(residency.resident))
        yield from (budget, used, resident)

    def _loads(self):
        counts = self._on_demand.counts
        loads = CounterMetricFamily("ferry_model_loads", "On-demand loads, by model", labels=["model"])
        failures = CounterMetricFamily("ferry_model_load_failures", "On-demand loads that failed, by model", labels=["model"])
        seconds = CounterMetricFamily("ferry_model_load_duration_seconds", "Time spent in on-demand loads (failed ones too), "
                                      "by model", labels=["model"])
        evictions = CounterMetricFamily("ferry_model_evictions", "Models unloaded to keep within the memory budget, by "
                                        "model and why (lru: room for a load; over_budget: a load measured larger "
                                        "than expected)", labels=["model", "reason"])
        for name, n in sorted(counts.loads.items()):
            loads.add_metric([name], n)
        for name, n in sorted(counts.failures.items()):
            failures.add_metric([name], n)
        for name, s in sorted(counts.load_seconds.items()):
            seconds.add_metric([name], s)
        for (name, why), n in sorted(counts.evictions.items()):
            evictions.add_metric([name, why], n)
        waiting = GaugeMetricFamily("ferry_model_load_waiting_requests", "Requests waiting for their model's on-demand "
                                    "load now, by model", labels=["model"])
        for name, n in sorted(counts.waiting.items()):
            waiting.add_metric([name], n)
        yield from (loads, failures, seconds, evictions, waiting)
