"""Triton's logging extension: read and change what the server logs while it runs.

Served as the `LogSettings` RPC and `GET`/`POST /v2/logging`, with Triton's keys, so
`tritonclient`'s `get_log_settings` / `update_log_settings` work unchanged:

- `log_info`, `log_warning`, `log_error` (bool): whether records of that severity are written;
- `log_verbose_level` (uint): above 0, DEBUG records too, among them the line per batch a runner cuts
  (what the window did), which is how an operator watches batching on a live server without a restart;
- `log_format`: `default` or `ISO8601` (UTC timestamps, `2026-12-01T10:20:33Z`);
- `log_file`: where the log goes, read-only here ("" = standard error, the process's own output); as
  in recent Triton, it is set at start and a change is refused.

The settings act on the root logger and its handlers: the logger's level decides which records are
made at all (a DEBUG record costs nothing while verbose logging is off), a filter drops severities
switched off above it. With `--frontend-processes`, the engine's log follows these settings; the
front-end processes keep the level they started with.
"""

from __future__ import annotations

import logging
import time

from server.errors import DisabledError, InvalidInputError

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("default", "ISO8601")
_SWITCHES = {"log_error": logging.ERROR, "log_warning": logging.WARNING, "log_info": logging.INFO}
_TYPES = {"log_file": str, "log_info": bool, "log_warning": bool, "log_error": bool, "log_verbose_level": int,
          "log_format": str}


class _Severities(logging.Filter):
    def __init__(self, settings: LogControl):
        super().__init__()
        self.settings = settings

    def filter(self, record: logging.LogRecord) -> bool:
        values = self.settings.values
        if record.levelno >= logging.ERROR:
            return values["log_error"]
        if record.levelno >= logging.WARNING:
            return values["log_warning"]
        if record.levelno >= logging.INFO:
            return values["log_info"]
        return values["log_verbose_level"] > 0


class LogControl:
    """The server's log settings, starting from `--log-level`; every change goes through `update`."""

    def __init__(self, root: logging.Logger | None = None, allow_updates: bool = True):
        self.root = root or logging.getLogger()
        self.allow_updates = allow_updates  # off: the settings can be read, not changed (--allow-log-settings)
        start = self.root.getEffectiveLevel()
        self.values: dict[str, bool | int | str] = {
            "log_file": "", "log_verbose_level": 1 if start <= logging.DEBUG else 0, "log_format": "default",
            **{key: start <= level for key, level in _SWITCHES.items()}}
        self._filter = _Severities(self)
        self._formats = {}
        for handler in self.root.handlers:
            handler.addFilter(self._filter)
            self._formats[handler] = handler.formatter

    def update(self, changes: dict[str, bool | int | str]) -> dict[str, bool | int | str]:
        """Apply `changes` (all or none: each key and value is checked first); returns every setting."""
        if changes and not self.allow_updates:
            raise DisabledError("changing the log settings is turned off on this server; start it with "
                                "--allow-log-settings to allow it (the admin token is needed too when tokens are set)")
        for key, value in changes.items():
            _check(key, value, self.values.get(key))
        self.values.update(changes)
        self.root.setLevel(self._level())
        for handler, formatter in self._formats.items():
            handler.setFormatter(_iso_formatter() if self.values["log_format"] == "ISO8601" else formatter)
        return dict(self.values)

    def _level(self) -> int:
        """The lowest severity any switch lets through, so no record is made only to be dropped."""
        if self.values["log_verbose_level"] > 0:
            return logging.DEBUG
        enabled = [level for key, level in _SWITCHES.items() if self.values[key]]
        return min(enabled, default=logging.CRITICAL)


def _check(key: str, value, current) -> None:
    if key not in _TYPES:
        raise InvalidInputError(f"unknown log setting '{key}'; the settings are {', '.join(_TYPES)}")
    expected = _TYPES[key]
    if type(value) is not expected:
        kind = {bool: "a bool", int: "an unsigned integer", str: "a string"}[expected]
        raise InvalidInputError(f"log setting '{key}' takes {kind}, got {type(value).__name__} {value!r}")
    if key == "log_format" and value not in FORMATS:
        raise InvalidInputError(f"log_format must be one of {', '.join(FORMATS)}, got '{value}'")
    if key == "log_verbose_level" and value < 0:
        raise InvalidInputError(f"log_verbose_level must be 0 or more, got {value}")
    if key == "log_file" and value != current:
        raise InvalidInputError("log_file is set when the server starts (its standard error); it cannot be "
                                "changed while it runs")


def _iso_formatter() -> logging.Formatter:
    formatter = logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%dT%H:%M:%SZ")
    formatter.converter = time.gmtime
    return formatter
