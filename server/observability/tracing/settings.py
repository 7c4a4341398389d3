"""Triton's trace settings: what `--trace-config` sets at start and `TraceSetting` / `/v2/trace/setting` change.

The keys and value forms are Triton's, so `tritonclient`'s `get_trace_settings` / `update_trace_settings`
work unchanged: every value travels as a string, `trace_level` as a list of strings.

- `trace_level`: `OFF`, or any of `TIMESTAMPS`, `TENSORS`;
- `trace_rate`: one request in N is traced (0: none, unless a client sent an OpenTelemetry context);
- `trace_count`: traces still to take (-1: no limit); when it reaches 0 the traces taken are written to
  the next indexed file (`FILE.0`, `FILE.1`, ...);
- `log_frequency`: write `FILE.<i>` every N traces (0: one file, `FILE`, kept a valid JSON array);
- `trace_file`: set at start only (as in recent Triton: a network call must not choose where the server
  writes); `trace_mode`: `triton` or `opentelemetry`, set at start only.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from server.errors import InvalidInputError

TIMESTAMPS, TENSORS, OFF = "TIMESTAMPS", "TENSORS", "OFF"
TRITON, OPENTELEMETRY = "triton", "opentelemetry"
DEFAULT_OTLP_URL = "http://localhost:4318/v1/traces"
KEYS = ("trace_file", "trace_level", "trace_rate", "trace_count", "log_frequency", "trace_mode")


@dataclass(frozen=True, slots=True)
class OtelOptions:
    """`--trace-config opentelemetry,...`: where spans go and how the batch span processor batches them."""

    url: str = ""  # "": OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (or ..._ENDPOINT + /v1/traces), else DEFAULT_OTLP_URL
    resource: tuple[tuple[str, str], ...] = ()  # resource attributes beside service.name
    max_queue_size: int = 2048  # spans held for export; beyond it new spans are dropped (and counted)
    schedule_delay_ms: int = 5000
    max_export_batch_size: int = 512


@dataclass(frozen=True, slots=True)
class TraceSettings:
    level: tuple[str, ...] = ()  # empty: OFF
    rate: int = 1000
    count: int = -1
    log_frequency: int = 0
    file: str = ""
    mode: str = TRITON
    otel: OtelOptions = field(default_factory=OtelOptions)

    @property
    def on(self) -> bool:
        """Whether requests are sampled at all under these settings."""
        return bool(self.level) and (self.mode == OPENTELEMETRY or bool(self.file))

    def values(self, count: int | None = None) -> dict[str, str | list[str]]:
        """Triton's answer: every key, values as strings (`count`: the sampler's remaining count)."""
        return {"trace_file": self.file, "trace_level": list(self.level) or [OFF],
                "trace_rate": str(self.rate), "trace_count": str(self.count if count is None else count),
                "log_frequency": str(self.log_frequency), "trace_mode": self.mode}


def apply(settings: TraceSettings, changes: dict[str, list[str] | str | None], fallback: TraceSettings) -> TraceSettings:
    """`settings` with `changes` applied (all or none); a None value takes the key's value from `fallback`."""
    updated = {}
    for key, value in changes.items():
        if key not in KEYS:
            raise InvalidInputError(f"unknown trace setting '{key}'; the settings are {', '.join(KEYS)}")
        attr = _ATTR[key]
        updated[attr] = getattr(fallback, attr) if value is None else _parse(key, value, getattr(settings, attr))
    return replace(settings, **updated)


_ATTR = {"trace_file": "file", "trace_level": "level", "trace_rate": "rate", "trace_count": "count",
         "log_frequency": "log_frequency", "trace_mode": "mode"}


def _parse(key: str, value, current):
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise InvalidInputError(f"trace setting '{key}' takes a string or a list of strings, got {value!r}")
    if key == "trace_level":
        return levels(values)
    if len(values) != 1:
        raise InvalidInputError(f"trace setting '{key}' takes one value, got {len(values)}")
    text = values[0]
    if key == "trace_file":
        if text != current:
            raise InvalidInputError("trace file location can not be updated through network protocol; it is set "
                                    "when the server starts (--trace-config triton,file=PATH)")
        return text
    if key == "trace_mode":
        if text != current:
            raise InvalidInputError(f"trace mode is set when the server starts (--trace-config mode=...); it is "
                                    f"'{current}', got '{text}'")
        return text
    lowest = -1 if key == "trace_count" else 0
    return number(key, text, lowest)


def levels(values: list[str]) -> tuple[str, ...]:
    chosen = []
    for v in values:
        level = v.upper()
        if level not in (OFF, TIMESTAMPS, TENSORS):
            raise InvalidInputError(f"trace level must be OFF, TIMESTAMPS or TENSORS, got '{v}'")
        if level != OFF and level not in chosen:
            chosen.append(level)
    if OFF in (v.upper() for v in values) and chosen:
        raise InvalidInputError("trace level OFF cannot be combined with other levels")
    return tuple(chosen)


def number(key: str, text: str, lowest: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < lowest:
        raise InvalidInputError(f"trace setting '{key}' must be an integer of {lowest} or more, got '{text}'")
    return value


def from_flags(values: list[str]) -> TraceSettings:
    """`--trace-config` as Triton reads it: `SETTING=VALUE` (rate, level, count, mode), `triton,SETTING=VALUE`
    (file, log-frequency), `opentelemetry,SETTING=VALUE` (url, resource=KEY=VALUE, bsp_*). Raises ValueError."""
    settings, otel, levels_given = TraceSettings(), OtelOptions(), []
    for flag in values:
        section, _, rest = flag.partition(",") if flag.startswith((TRITON + ",", OPENTELEMETRY + ",")) else ("", "", flag)
        key, eq, value = rest.partition("=")
        if not eq:
            raise ValueError(f"--trace-config {flag}: expected [triton,|opentelemetry,]SETTING=VALUE")
        if section == OPENTELEMETRY:
            otel = _otel_option(otel, key, value, flag)
            continue
        settings = _setting(settings, section, key, value, flag, levels_given)
    if levels_given:
        settings = replace(settings, level=_flag_levels(levels_given))
    return replace(settings, otel=otel)


def _setting(settings: TraceSettings, section: str, key: str, value: str, flag: str, levels_given: list) -> TraceSettings:
    try:
        if section == TRITON and key == "file":
            return replace(settings, file=value)
        if section == TRITON and key == "log-frequency":
            return replace(settings, log_frequency=number("log-frequency", value, 0))
        if not section and key == "rate":
            return replace(settings, rate=number("rate", value, 0))
        if not section and key == "count":
            return replace(settings, count=number("count", value, -1))
        if not section and key == "level":
            levels_given.append(value)
            return settings
        if not section and key == "mode":
            if value not in (TRITON, OPENTELEMETRY):
                raise ValueError(f"mode must be triton or opentelemetry, got '{value}'")
            return replace(settings, mode=value)
    except InvalidInputError as exc:
        raise ValueError(f"--trace-config {flag}: {exc.message}") from None
    raise ValueError(f"--trace-config {flag}: unknown setting; Triton's are rate, level, count, mode, "
                     "triton,file, triton,log-frequency, opentelemetry,url, opentelemetry,resource")


def _flag_levels(given: list[str]) -> tuple[str, ...]:
    """Repeated `level=` flags add levels; `level=OFF` (the last word) turns tracing off."""
    if given[-1].upper() == OFF:
        return ()
    try:
        return levels([g for g in given if g.upper() != OFF])
    except InvalidInputError as exc:
        raise ValueError(f"--trace-config level: {exc.message}") from None


def _otel_option(otel: OtelOptions, key: str, value: str, flag: str) -> OtelOptions:
    if key == "url":
        return replace(otel, url=value)
    if key == "resource":
        name, eq, attr = value.partition("=")
        if not eq or not name:
            raise ValueError(f"--trace-config {flag}: expected resource=KEY=VALUE")
        return replace(otel, resource=(*otel.resource, (name, attr)))
    sizes = {"bsp_max_queue_size": "max_queue_size", "bsp_schedule_delay": "schedule_delay_ms",
             "bsp_max_export_batch_size": "max_export_batch_size"}
    if key in sizes:
        try:
            return replace(otel, **{sizes[key]: number(key, value, 1)})
        except InvalidInputError as exc:
            raise ValueError(f"--trace-config {flag}: {exc.message}") from None
    raise ValueError(f"--trace-config {flag}: unknown OpenTelemetry setting; they are url, resource, "
                     "bsp_max_queue_size, bsp_schedule_delay, bsp_max_export_batch_size")
