"""The server's tracing: settings (global and per model), sampling, and where finished traces go.

Front doors call `begin` for every request; it answers None unless this request is sampled, so a
request that is not traced carries nothing further. A model's own settings hold only the keys set
for it; every other key follows the global settings, as Triton's do. Each settings owner (the
global settings, a model with settings of its own) samples on its own counter: one request in
`trace_rate`, until `trace_count` runs out.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Mapping

from server.errors import DisabledError
from server.observability.tracing import settings as ts
from server.observability.tracing.file_writer import TraceFileWriter
from server.observability.tracing.record import Trace

log = logging.getLogger(__name__)


class _Sampler:
    """One settings owner's counters: requests seen, traces left (-1: no limit), traces in flight."""

    __slots__ = ("settings", "seen", "left", "in_flight", "counted")

    def __init__(self, settings: ts.TraceSettings):
        self.settings = settings
        self.seen = 0
        self.left = settings.count
        self.in_flight = 0
        self.counted = settings.count != -1  # traces taken under a count go to indexed files

    def take(self, forced: bool) -> bool:
        """Whether this request is traced: one in `rate`, while the count lasts; `forced`: a client's
        OpenTelemetry context asks for it (Triton traces those whatever the rate)."""
        if self.left == 0:
            return False
        self.seen += 1
        rate = self.settings.rate
        if not forced and (rate == 0 or self.seen % rate):
            return False
        if self.left > 0:
            self.left -= 1
        self.in_flight += 1
        return True


class TraceControl:
    def __init__(self, initial: ts.TraceSettings | None = None, allow_updates: bool = False, otel=None,
                 writer: TraceFileWriter | None = None):
        """`otel`: the OpenTelemetry exporter (tracing/otel.py) in that mode; `allow_updates`: clients may
        change the settings (--allow-trace-settings)."""
        self.initial = initial or ts.TraceSettings()
        self.allow_updates = allow_updates
        self.otel = otel
        self.writer = writer or TraceFileWriter()
        self._global = _Sampler(self.initial)
        self._models: dict[str, tuple[dict, _Sampler]] = {}  # model -> (its own changes, its sampler)
        self._ids = itertools.count(1)
        self.active = self.initial.on  # False: begin() answers None at once
        self._watchers: list[Callable[[bool], None]] = []

    def watch(self, changed: Callable[[bool], None]) -> None:
        """`changed(active)` after every settings change (front-end processes learn whether to trace)."""
        self._watchers.append(changed)

    # -- settings -----------------------------------------------------------------------------------
    def values(self, model: str | None = None) -> dict[str, str | list[str]]:
        sampler = self._sampler(model)
        return sampler.settings.values(sampler.left)

    def update(self, changes: Mapping[str, list[str] | str | None], model: str | None = None) -> dict:
        """Apply `changes` (all or none) globally or to `model`'s own settings; returns the settings in force."""
        if changes and not self.allow_updates:
            raise DisabledError("changing the trace settings is turned off on this server; start it with "
                                "--allow-trace-settings to allow it (the admin token is needed too when tokens are set)")
        if not changes:
            return self.values(model)
        if model:
            self._update_model(model, dict(changes))
        else:
            self._update_global(dict(changes))
        self.active = self._global.settings.on or any(s.settings.on for _, s in self._models.values())
        for changed in self._watchers:
            changed(self.active)
        return self.values(model)

    def _update_global(self, changes: dict) -> None:
        updated = ts.apply(self._global.settings, changes, self.initial)
        self._global = _Sampler(updated)
        for model, (own, _) in list(self._models.items()):  # keys a model did not set follow the new globals
            self._models[model] = (own, _Sampler(ts.apply(updated, own, updated)))

    def _update_model(self, model: str, changes: dict) -> None:
        own, _ = self._models.get(model, ({}, None))
        base = self._global.settings
        ts.apply(base, {**own, **changes}, base)  # checks every value before anything changes
        own = {**own, **changes}
        own = {k: v for k, v in own.items() if v is not None}  # None: back to the global value
        if own:
            self._models[model] = (own, _Sampler(ts.apply(base, own, base)))
        else:
            self._models.pop(model, None)

    def _sampler(self, model: str | None) -> _Sampler:
        if model:
            found = self._models.get(model)
            if found is not None:
                return found[1]
        return self._global

    # -- traces -------------------------------------------------------------------------------------
    def begin(self, model: str, request_id: str, arrival_ns: int,
              carrier: Mapping[str, str] | None = None) -> Trace | None:
        """A new trace for this request if it is sampled, else None. `carrier`: the request's headers or
        metadata, for a W3C `traceparent` (OpenTelemetry mode)."""
        if not self.active:
            return None
        sampler = self._sampler(model)
        settings = sampler.settings
        if not settings.on:
            return None
        forced = self.otel is not None and carrier is not None and "traceparent" in carrier
        if not sampler.take(forced):
            return None
        trace = Trace(next(self._ids), model, self._finished, request_id, tensor_level=ts.TENSORS in settings.level)
        trace.owner, trace.control = sampler, self
        if self.otel is not None:
            self.otel.start(trace, carrier, arrival_ns)
        return trace

    def child(self, parent: Trace, model: str, version: int) -> Trace:
        """A child request's trace (an ensemble step, a BLS call), written with `parent_id` (and, in
        OpenTelemetry, a child span)."""
        trace = parent.child(model, version, self._ids.__next__)
        if self.otel is not None:
            self.otel.start(trace, None)
        return trace

    def _finished(self, trace: Trace) -> None:
        sampler: _Sampler = trace.owner
        if self.otel is not None:
            self.otel.finish(trace)
            return
        settings = sampler.settings
        self.writer.add(settings.file, trace.entries, settings.log_frequency, sampler.counted)
        if trace.parent is not None:  # a child request: counted with its parent
            return
        sampler.in_flight -= 1
        if sampler.counted and sampler.left == 0 and sampler.in_flight == 0:
            self.writer.roll(settings.file)

    def close(self) -> None:
        """Write what is left (the server is stopping: no request is in flight)."""
        self.writer.close()
        if self.otel is not None:
            self.otel.close()

