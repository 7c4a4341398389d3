"""OpenAI's `response_format`, and vLLM's structured-output fields, as the runner's sampling keys.

`{"type": "json_object"}` asks for any JSON object, `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}` for one valid against the schema (always enforced, whatever `strict` says: the
decoder cannot produce anything else), `{"type": "text"}` for nothing. vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` pass through unchanged; the
runner (runners/constraints.py) refuses a request that names two constraints.
"""

from __future__ import annotations

from server.errors import InvalidInputError
from server.runners import constraints

FIELDS = frozenset({"response_format"}) | constraints.KEYS


def structured_of(body: dict) -> dict:
    """The sampling entries that carry `body`'s constraint (none when it has none)."""
    out = {key: body[key] for key in constraints.KEYS if body.get(key) is not None}
    wanted = _response_format(body.get("response_format"))
    if wanted is not None:
        if "structured_outputs" in out:
            raise InvalidInputError("give either 'response_format' or 'structured_outputs', not both")
        out["structured_outputs"] = wanted
    return out


def _response_format(value) -> dict | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or spec.get("schema") is None:
            raise InvalidInputError("'response_format.json_schema' must be an object with a 'schema' "
                                    "(and a 'name'), as OpenAI's structured outputs define it")
        return {"json": spec["schema"]}
    raise InvalidInputError(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}")
