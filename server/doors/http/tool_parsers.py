"""A model's text -> (content, tool calls), in the formats people deploy; chosen by the model's config
parameter `tool_call_parser`, as vLLM's `--tool-call-parser`.

- `hermes` (Hermes, Qwen2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block
  per call, text before the first block is content.
- `llama3_json` (Llama 3.1-3.3): the output is a JSON object `{"name": ..., "parameters": {...}}`, or
  several joined by `;`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers), or
  `[TOOL_CALLS]name[ARGS]{...}` repeated (v11 and later).

What does not parse as the format says (a cut-off block, bad JSON, a call without a name) is returned
as plain content with no calls: the client sees what the model wrote, never an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's `function.arguments`


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): content None when the text held only calls."""
    found = _PARSERS[parser](text)
    if found is None:
        return text, []
    content, calls = found
    return (content if content.strip() else None), calls


def start_marker(parser: str) -> str:
    """Text that opens the calls in a stream: content before it is streamed as it comes."""
    return {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": ""}[parser]


def _hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    start = text.find("<tool_call>")
    if start < 0:
        return None
    blocks = _HERMES.findall(text, start)
    rest = _HERMES.sub("", text[start:]).strip()
    if not blocks or rest:  # an unclosed block, or text between calls: not this format
        return None
    calls = [_call(block) for block in blocks]
    return None if None in calls else (text[:start], calls)


def _llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    calls = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        calls.append(_call_of(value, "parameters"))
        at = _skip(body, at, ";")
    return None if None in calls or not calls else ("", calls)


def _mistral(text: str) -> tuple[str, list[ToolCall]] | None:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    body = text[start + len("[TOOL_CALLS]"):].strip()
    if body.startswith("["):
        try:
            value = json.loads(body)
        except ValueError:
            return None
        calls = [_call_of(v, "arguments") for v in value] if isinstance(value, list) and value else [None]
    else:
        calls = [_named_args(part) for part in body.split("[TOOL_CALLS]")]
    return None if None in calls else (text[:start], calls)


def _named_args(part: str) -> ToolCall | None:
    name, sep, args = part.partition("[ARGS]")
    if not sep or not name.strip():
        return None
    try:
        value = json.loads(args)
    except ValueError:
        return None
    return ToolCall(name.strip(), json.dumps(value)) if isinstance(value, dict) else None


def _call(block: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(block), "arguments")
    except ValueError:
        return None


def _call_of(value, key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(key, value.get("arguments" if key == "parameters" else "parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return ToolCall(value["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def _skip(text: str, at: int, separator: str) -> int:
    while at < len(text) and (text[at].isspace() or text[at] == separator):
        at += 1
    return at


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}
PARSERS = tuple(_PARSERS)
