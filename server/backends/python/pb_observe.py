"""`pb_utils.MetricFamily`, `Metric` and `Logger` in a model process: updates go to the server, which
owns the Prometheus families and the log (a model process has no /metrics page or log of its own)."""

from __future__ import annotations

import enum
import threading
import weakref


def _host():
    from server.backends.python import pb_utils  # the one host of this process, installed before model.py runs

    return pb_utils._the_host()


def _refused(message: str) -> Exception:
    """Triton refuses a metric misuse with TritonModelException (model code catches that one)."""
    from server.backends.python import pb_utils

    return pb_utils.TritonModelException(message)


class LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class Logger:
    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, LogLevel.VERBOSE  # Triton's aliases

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        if not isinstance(message, str) or not isinstance(level, LogLevel):  # as Triton's bindings refuse them
            raise TypeError(f"Logger.log(message: str, level: pb_utils.LogLevel): got {type(message).__name__} and "
                            f"{type(level).__name__}")
        _host().log(int(level), message)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, LogLevel.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, LogLevel.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, LogLevel.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, LogLevel.VERBOSE)


class MetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

    def __init__(self, name: str, description: str, kind: int, buckets=None):
        if kind not in (self.COUNTER, self.GAUGE, self.HISTOGRAM):
            raise _refused(f"metric family '{name}': kind must be COUNTER, GAUGE or HISTOGRAM, got {kind!r}")
        known = _FAMILIES.get(name)
        if known is not None and known.kind != kind:  # Triton: one name, one kind, while the family lives
            raise _refused(f"metric family '{name}' exists already with another kind")
        self.name, self.description, self.kind = name, description, kind
        self.buckets = list(buckets) if buckets is not None else None
        _FAMILIES[name] = self
        _host().metric("family", self.name, self.description, self.kind, (), 0.0, self.buckets)

    def Metric(self, labels: dict | None = None, buckets=None) -> Metric:  # Triton's name
        if self.kind == self.HISTOGRAM and buckets is None and self.buckets is None:
            raise _refused(f"metric family '{self.name}' is a histogram: give its buckets")
        buckets = [float(b) for b in buckets] if buckets is not None else self.buckets
        if buckets is not None and any(a >= b for a, b in zip(buckets, buckets[1:])):
            raise _refused(f"metric family '{self.name}': histogram buckets must be in strictly ascending order, "
                           f"got {buckets}")
        return Metric(self, labels or {}, buckets)


class _Value:
    """What Metrics of one family and labels share: as in Triton, a second Metric with the same labels is the same metric."""

    def __init__(self):
        self.value = 0.0
        self.lock = threading.Lock()


# Live families by name and values by (family, labels), in this process: gone once model code drops them.
_FAMILIES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_VALUES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Metric:
    def __init__(self, family: MetricFamily, labels: dict, buckets):
        self.family, self.buckets = family, buckets
        self.labels = tuple(sorted((str(k), str(v)) for k, v in labels.items()))
        key = (family.name, family.kind, self.labels)
        self._shared = _VALUES.get(key)
        if self._shared is None:
            self._shared = _VALUES[key] = _Value()
        self._send("create", 0.0)

    def _send(self, op: str, value: float) -> None:
        f = self.family
        _host().metric(op, f.name, f.description, f.kind, self.labels, float(value), self.buckets)

    def increment(self, value: float) -> None:
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise _refused(f"metric family '{self.family.name}' is a histogram: use observe")
        if self.family.kind == MetricFamily.COUNTER and value < 0:
            raise _refused(f"metric family '{self.family.name}' is a counter: it cannot decrease")
        with self._shared.lock:
            self._shared.value += value
        self._send("inc", value)

    def set(self, value: float) -> None:
        if self.family.kind != MetricFamily.GAUGE:
            raise _refused(f"metric family '{self.family.name}' is not a gauge: only a gauge can be set")
        with self._shared.lock:
            self._shared.value = float(value)
        self._send("set", value)

    def observe(self, value: float) -> None:
        if self.family.kind != MetricFamily.HISTOGRAM:
            raise _refused(f"metric family '{self.family.name}' is not a histogram: only a histogram observes")
        with self._shared.lock:
            self._shared.value += value
        self._send("observe", value)

    def value(self) -> float:
        """The counter's or gauge's value, as this process knows it; a histogram has none (as in Triton)."""
        if self.family.kind == MetricFamily.HISTOGRAM:
            raise _refused(f"metric family '{self.family.name}' is a histogram: it has no single value")
        return self._shared.value
