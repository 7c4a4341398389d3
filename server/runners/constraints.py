"""Structured-output requests as clients send them -> one Constraint, or a refusal naming the field.

vLLM has two spellings and Ferry takes both, from every entrance (OpenAI, Generate, Triton's
`sampling_parameters`): the older top-level `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, and the newer `structured_outputs` object with `json`, `regex`, `choice`,
`grammar` and `json_object`. OpenAI's `response_format` is turned into the latter by its door. One
request carries at most one constraint: two are refused rather than one silently dropped. Only the
shape is checked here; whether the engine can compile the schema or grammar is guided.py's answer,
still before the request is scheduled.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from server.errors import InvalidInputError
from server.scheduling.sequence import Constraint

GUIDED_KEYS = frozenset({"guided_json", "guided_regex", "guided_choice", "guided_grammar"})
KEYS = GUIDED_KEYS | {"structured_outputs"}
_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
ANY_OBJECT = json.dumps({"type": "object"})


def constraint_of(given: Mapping[str, Any]) -> Constraint | None:
    """The one constraint among `given`'s structured-output fields, or None when it has none."""
    found = [(key.removeprefix("guided_"), given[key], key) for key in sorted(GUIDED_KEYS) if given.get(key) is not None]
    outputs = given.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, Mapping):
            raise InvalidInputError(f"'structured_outputs' must be an object with one of {list(_FIELDS)}, got {outputs!r}")
        # vLLM's switches that change nothing here: JSON is always compact, and there is one engine (no fallback)
        unknown = set(outputs) - set(_FIELDS) - {"disable_any_whitespace", "disable_fallback"}
        if unknown:
            raise InvalidInputError(f"unsupported 'structured_outputs' fields {sorted(unknown)}; supported: {list(_FIELDS)}")
        found += [(f, outputs[f], f"structured_outputs.{f}") for f in _FIELDS
                  if outputs.get(f) is not None and outputs.get(f) is not False]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidInputError(f"one structured-output constraint per request, got {[name for _, _, name in found]}")
    kind, value, name = found[0]
    return Constraint(*_checked(kind, value, name))


def _checked(kind: str, value: Any, name: str) -> tuple[str, str]:
    if kind == "json_object":
        if value is not True:
            raise InvalidInputError(f"'{name}' must be true, got {value!r}")
        return "json", ANY_OBJECT
    if kind == "json":
        return "json", _schema(value, name)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidInputError(f"'{name}' must be a non-empty list of strings, got {value!r}")
        return "choice", json.dumps(value)
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"'{name}' must be a non-empty string, got {value!r}")
    return kind, value


def _schema(value: Any, name: str) -> str:
    """A JSON schema given as an object or as its JSON text, made canonical so equal schemas share a compile."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidInputError(f"'{name}' is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidInputError(f"'{name}' must be a JSON schema (an object), got {type(value).__name__}")
    return json.dumps(value, sort_keys=True)
