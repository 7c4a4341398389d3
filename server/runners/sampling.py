"""Sampling parameters as a client sent them (any JSON-ish values) -> one checked SamplingParams.

Both generation entrances (Generate and ModelStreamInfer's `sampling_parameters`) come through here,
so a value that passes is one the sampler can run for any neighbour in the step: a bad value fails
its own request with INVALID_ARGUMENT before it is scheduled, never the step it would have joined.
NaN fails every comparison, so each number is checked finite before its range.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from server.errors import InvalidInputError
from server.runners import constraints
from server.scheduling.sequence import SamplingParams

KEYS = frozenset({"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs"}) | constraints.KEYS
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's top_logprobs
# Below this a temperature is greedy: logits / 1e-40 overflow to inf and softmax gives NaN, while
# anything this cold picks the top token anyway (a gap of 1e-3 in logits is e^100 apart).
GREEDY_BELOW = 1e-5
_INT_LIMIT = 2**63  # the sampler builds int64 tensors from top_k
# Each scalar field's type, for values Triton's vLLM convention sends as JSON strings ("0.1", "5", "true").
_FLOATS = frozenset({"temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"})
_INTEGERS = frozenset({"max_tokens", "top_k", "seed", "min_tokens", "logprobs"})
_FLAGS = frozenset({"ignore_eos"})


def from_strings(given: Mapping[str, Any]) -> dict[str, Any]:
    """Triton's vLLM backend convention: every value may come as a string, converted to its field's type.

    Triton's own `sampling_parameters` example sends `{"temperature": "0.1", "max_tokens": "100"}`.
    A string that does not read as its field's type is left as it is, so `sampling_params` refuses it
    with the field's rule (and a NaN or "inf" read as a float is refused there as not finite)."""
    return {key: _typed(key, value) if isinstance(value, str) else value for key, value in given.items()}


def _typed(key: str, text: str) -> Any:
    try:
        if key in _FLOATS:
            return float(text)
        if key in _INTEGERS:
            return int(text.strip(), 10)
    except ValueError:
        return text
    if key in _FLAGS and text.strip().lower() in ("true", "false"):
        return text.strip().lower() == "true"
    return text


def sampling_params(given: Mapping[str, Any], default_max_tokens: int) -> SamplingParams:
    """Check every value's type and range; 0 (or absent) max_tokens, top_k, top_p mean the defaults."""
    unknown = set(given) - KEYS
    if unknown:
        raise InvalidInputError(f"unsupported sampling parameters {sorted(unknown)}; supported: {sorted(KEYS)}")
    temperature = _number(given, "temperature", 0.0)
    if temperature < 0:
        raise InvalidInputError(f"sampling parameter 'temperature' must be >= 0, got {temperature!r}")
    top_p = _number(given, "top_p", 0.0) or 1.0
    if not 0 < top_p <= 1:
        raise InvalidInputError(f"sampling parameter 'top_p' must be within (0, 1], got {top_p!r}")
    seed = given.get("seed")
    max_tokens = _integer(given, "max_tokens") or default_max_tokens
    min_tokens = _integer(given, "min_tokens")
    if min_tokens > max_tokens:
        raise InvalidInputError(f"sampling parameter 'min_tokens' ({min_tokens}) must be <= max_tokens ({max_tokens})")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_BELOW else temperature,
        top_k=_integer(given, "top_k"), top_p=top_p,
        seed=None if seed is None else _integer(given, "seed", low=-_INT_LIMIT),
        stop=_stop_strings(given.get("stop")), stop_token_ids=_token_ids(given.get("stop_token_ids")),
        ignore_eos=_flag(given, "ignore_eos"), min_tokens=min_tokens, **_penalties(given),
        constraint=constraints.constraint_of(given),
    )


def _penalties(given: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ranges: repetition_penalty > 0 (1 is off), presence and frequency within [-2, 2];
    and logprobs within [0, 20], checked here since it is a plain integer beside them."""
    repetition = _number(given, "repetition_penalty", 1.0)
    if repetition <= 0:
        raise InvalidInputError(f"sampling parameter 'repetition_penalty' must be > 0, got {repetition!r}")
    values = {"repetition_penalty": repetition}
    for key in ("presence_penalty", "frequency_penalty"):
        values[key] = _number(given, key, 0.0)
        if not -2 <= values[key] <= 2:
            raise InvalidInputError(f"sampling parameter '{key}' must be within [-2, 2], got {values[key]!r}")
    logprobs = given.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise InvalidInputError(f"sampling parameter 'logprobs' must be an integer within [0, {MAX_LOGPROBS}], got {logprobs!r}")
    values["logprobs"] = logprobs
    return values


def _number(given: Mapping[str, Any], key: str, default: float) -> float:
    value = given.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidInputError(f"sampling parameter '{key}' must be a finite number, got {value!r}")
    return float(value)


def _integer(given: Mapping[str, Any], key: str, low: int = 0) -> int:
    value = given.get(key) or 0
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < _INT_LIMIT:
        raise InvalidInputError(f"sampling parameter '{key}' must be an integer within [{low}, 2**63), got {value!r}")
    return value


def _flag(given: Mapping[str, Any], key: str) -> bool:
    value = given.get(key, False)
    if not isinstance(value, bool):
        raise InvalidInputError(f"sampling parameter '{key}' must be true or false, got {value!r}")
    return value


def _stop_strings(value: Any) -> tuple[str, ...]:
    stops = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, (list, tuple)) else None
    if value is None:
        return ()
    if stops is None or not all(isinstance(s, str) for s in stops):
        raise InvalidInputError(f"sampling parameter 'stop' must be a string or a list of strings, got {value!r}")
    return stops


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = tuple(value) if isinstance(value, (list, tuple)) else None
    if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < _INT_LIMIT for t in ids):
        raise InvalidInputError(f"sampling parameter 'stop_token_ids' must be a list of token ids (integers >= 0), got {value!r}")
    return ids
