"""Metrics Python models declare (Triton's pb_utils.MetricFamily), kept by the server and shown on /metrics.

A model process sends each update over its link (server/backends/python/); the values live here, so
they survive a model process's restart and are rendered with the server's own families. As in
Triton, the model names its families and labels; counters are shown under their bare name (no
`_total`, metrics.BareCounter), as Triton shows them. A family's kind is fixed by its first
declaration; a later declaration of the same name with another kind is refused in the model's log.
"""

from __future__ import annotations

import bisect
import logging
import re
import threading

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from server.observability.metrics import BareCounter

log = logging.getLogger(__name__)
COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
_KINDS = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


class _Family:
    def __init__(self, name: str, description: str, kind: int):
        self.name, self.description, self.kind = name, description, kind
        self.values: dict[tuple, float | list] = {}  # labels -> value, or [bucket bounds, counts, sum, count]


class CustomMetrics(Collector):
    def __init__(self):
        self._families: dict[str, _Family] = {}
        self._lock = threading.Lock()

    def update(self, model: str, op: str, name: str, description: str, kind: int, labels: tuple, value: float,
               buckets) -> None:
        """One update from a model process (called on its reader thread)."""
        with self._lock:
            family = self._family(model, name, description, kind, labels)
            if family is None or op == "family":
                return
            if family.kind == HISTOGRAM:
                state = family.values.setdefault(labels, [sorted(buckets or []), [0] * (len(buckets or []) + 1), 0.0, 0])
                if op == "observe":
                    state[1][bisect.bisect_left(state[0], value)] += 1
                    state[2] += value
                    state[3] += 1
                return
            current = family.values.setdefault(labels, 0.0)
            if op == "inc":
                family.values[labels] = current + value
            elif op == "set":
                family.values[labels] = value

    def _family(self, model: str, name: str, description: str, kind: int, labels: tuple) -> _Family | None:
        family = self._families.get(name)
        if family is None:
            if not _NAME.match(name) or kind not in _KINDS:
                log.error("model '%s': metric family %r is not a valid Prometheus name or kind; ignored", model, name)
                return None
            family = self._families[name] = _Family(name, description, kind)
        if family.kind != kind:
            log.error("model '%s': metric family '%s' is a %s already; its %s update is ignored", model, name,
                      _KINDS[family.kind], _KINDS.get(kind, "unknown"))
            return None
        if any(not _LABEL.match(key) or key == "le" for key, _ in labels):
            log.error("model '%s': metric '%s' has a label name Prometheus refuses: %s; ignored", model, name, labels)
            return None
        return family

    def collect(self):
        with self._lock:
            families = [(f.name, f.description, f.kind, dict(f.values)) for f in self._families.values()]
        for name, description, kind, values in families:
            metric = BareCounter(name, description) if kind == COUNTER else Metric(name, description, _KINDS[kind])
            for labels, value in values.items():
                if kind == HISTOGRAM:
                    bounds, counts, total, count = value
                    below = 0
                    for bound, n in zip([*bounds, float("inf")], counts):
                        below += n
                        metric.add_sample(f"{name}_bucket", {**dict(labels), "le": _le(bound)}, below)
                    metric.add_sample(f"{name}_count", dict(labels), count)
                    metric.add_sample(f"{name}_sum", dict(labels), total)
                else:
                    metric.add_sample(name, dict(labels), value)
            yield metric


def _le(bound: float) -> str:
    """A bucket bound as Triton prints its custom histograms' (prometheus-cpp): `1`, `2.5`, `+Inf`, where the
    Python client would print `1.0`; model code and dashboards written for Triton match the text."""
    if bound.is_integer() and abs(bound) < 1e15:
        return str(int(bound))
    return floatToGoString(bound)
