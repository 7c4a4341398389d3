"""OpenAI tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`.

The tools reach the model through its chat template's `tools` argument (Hugging Face's convention), and
earlier assistant `tool_calls` and `role: "tool"` results go back through the same template. What the
model writes becomes `tool_calls` three ways, as vLLM does it:
- `"auto"` (the default with tools): the model's own format, read by the parser its config names
  (tool_parsers.py); text that does not parse stays content.
- `"required"`: decoding is constrained to a JSON list of `{"name", "parameters"}` whose parameters
  are valid against that function's schema (one item when `parallel_tool_calls` is false).
- a named function: decoding is constrained to that function's parameters; the output is its arguments.
- `"none"`: the tools are still shown to the template, and the output is content.
Answers with calls end with `finish_reason: "tool_calls"` (a cut by max_tokens stays `length`).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from server.doors.http import tool_parsers
from server.doors.http.tool_parsers import ToolCall
from server.errors import InvalidInputError

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict]  # as the template gets them (OpenAI's objects)
    mode: str  # none, auto, required, named
    name: str | None  # the named function
    parallel: bool
    parser: str
    schemas: dict[str, dict]  # function name -> parameters schema

    def structured(self) -> dict | None:
        """The sampling entry that enforces `required` or a named function (None: free decoding)."""
        if self.mode == "named":
            return {"structured_outputs": {"json": self.schemas[self.name]}}
        if self.mode != "required":
            return None
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False} for name, schema in self.schemas.items()]}}
        if not self.parallel:
            calls["maxItems"] = 1
        return {"structured_outputs": {"json": calls}}

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished choice's text."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return (None, [ToolCall(self.name, json.dumps(json.loads(text)))]) if _is_json(text) else (text, [])
        if self.mode == "required":
            value = json.loads(text) if _is_json(text) else None
            if not isinstance(value, list) or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in value):
                return text, []
            return None, [ToolCall(v["name"], json.dumps(v.get("parameters", {}))) for v in value]
        content, calls = tool_parsers.parse(self.parser, text)
        return content, calls if self.parallel else calls[:1]


def plan_of(body: dict, parser: str) -> ToolPlan | None:
    """The request's tool plan, checked; None when it has no tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidInputError(f"'parallel_tool_calls' must be true or false, got {parallel!r}")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidInputError("'tool_choice' needs 'tools'")
        return None
    schemas = _schemas(tools)
    name = None
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if choice.get("type") == "function" and isinstance(function, dict) else None
        if not isinstance(name, str) or name not in schemas:
            raise InvalidInputError(f"'tool_choice' names function {name!r}, which is not among 'tools' {sorted(schemas)}")
        mode = "named"
    elif choice in (None, "auto", "none", "required"):
        mode = choice or "auto"
    else:
        raise InvalidInputError(f"'tool_choice' must be 'none', 'auto', 'required' or "
                                f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {choice!r}")
    if parser not in tool_parsers.PARSERS:
        raise InvalidInputError(f"the model's tool_call_parser {parser!r} is not one of {list(tool_parsers.PARSERS)}")
    return ToolPlan(tools, mode, name, parallel, parser, schemas)


def _schemas(tools) -> dict[str, dict]:
    if not isinstance(tools, list) or not tools:
        raise InvalidInputError("'tools' must be a non-empty list of {\"type\": \"function\", \"function\": {...}} objects")
    schemas = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidInputError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                    "\"parameters\": {...}}}")
        parameters = function.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise InvalidInputError(f"tools[{i}].function.parameters must be a JSON schema object")
        schemas[function["name"]] = parameters
    return schemas


def template_messages(messages: list[dict]) -> list[dict]:
    """Assistant `tool_calls` with their arguments as objects, as chat templates read them (OpenAI sends
    them as JSON text)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list):
            message = {**message, "tool_calls": [_readable(call) for call in calls]}
        out.append(message)
    return out


def _readable(call):
    function = call.get("function") if isinstance(call, dict) else None
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
        except ValueError:
            pass
    return call


def shaped(call: ToolCall, index: int | None = None) -> dict:
    """OpenAI's tool call object (with `index` in a stream's delta)."""
    out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolStream:
    """One streamed choice's text -> OpenAI deltas: content as it comes, calls as soon as they are known
    (a named function's arguments piece by piece; the others once their text is complete)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.text = ""  # everything generated
        self.held = ""  # content not yet sent: it may be the start of the calls' marker
        self.sent = 0  # characters of `text` sent as content
        self.calling = plan.mode in ("required", "named")  # past the marker: the rest is calls
        self.named_id = None

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if self.plan.mode == "named":
            return [self._named_delta(piece)] if piece else []
        if self.calling:
            return []
        self.held += piece
        marker = tool_parsers.start_marker(self.plan.parser)
        if self.plan.mode == "none":
            return self._release(len(self.held))
        if not marker:  # llama3_json: a call is the whole output, known by its first character
            stripped = self.held.lstrip()
            if not stripped:
                return []
            self.calling = stripped[0] in "{<"
            return [] if self.calling else self._release(len(self.held))
        at = self.held.find(marker)
        if at >= 0:
            self.calling = True
            return self._release(at)
        keep = next((k for k in range(min(len(marker) - 1, len(self.held)), 0, -1) if marker.startswith(self.held[-k:])), 0)
        return self._release(len(self.held) - keep)

    def _release(self, upto: int) -> list[dict]:
        sent, self.held = self.held[:upto], self.held[upto:]
        self.sent += len(sent)
        return [{"content": sent}] if sent else []

    def _named_delta(self, piece: str) -> dict:
        if self.named_id is None:
            call = shaped(ToolCall(self.plan.name, piece), 0)
            self.named_id = call["id"]
            return {"tool_calls": [call]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas left to send, and the finish reason to report."""
        if self.plan.mode == "named":
            return [], "tool_calls" if reason == "stop" and self.named_id is not None else reason
        if not self.calling:
            return self._release(len(self.held)), reason
        content, calls = self.plan.calls(self.text)
        if not calls:  # what looked like calls was not: it is content after all
            return [{"content": self.text[self.sent:]}], reason
        return [{"tool_calls": [shaped(call, i) for i, call in enumerate(calls)]}], "tool_calls" if reason == "stop" else reason
