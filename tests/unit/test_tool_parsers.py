"""Tool-call parsers on text in each format as models write it: one call, several, content before
them, arguments as objects or JSON strings; and malformed output comes back as plain content."""

from __future__ import annotations

import json

import pytest

from server.doors.http import tool_parsers
from server.doors.http.tool_parsers import ToolCall
from server.doors.http.tools import ToolPlan, ToolStream


def args(call: ToolCall) -> dict:
    return json.loads(call.arguments)


def test_hermes_qwen_several_calls_after_content():
    text = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = tool_parsers.parse("hermes", text)
    assert content == "Let me check both.\n"
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert args(calls[0]) == {"city": "Oslo", "unit": "c"} and args(calls[1]) == {"zone": "CET"}


def test_hermes_only_a_call_has_no_content():
    content, calls = tool_parsers.parse("hermes", '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert content is None and calls == [ToolCall("f", '{"x": 1}')]


def test_llama3_json_one_and_several():
    content, calls = tool_parsers.parse("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert content is None and calls[0].name == "get_weather" and args(calls[0]) == {"city": "Paris"}
    _, calls = tool_parsers.parse("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"n": 2}}')
    assert [c.name for c in calls] == ["a", "b"] and args(calls[1]) == {"n": 2}


def test_mistral_list_and_v11_formats():
    content, calls = tool_parsers.parse("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
                                                   '{"name": "get_time", "arguments": {}}]')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    _, calls = tool_parsers.parse("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}')
    assert [c.name for c in calls] == ["get_weather", "get_time"] and args(calls[0]) == {"city": "Rome"}


@pytest.mark.parametrize("parser, text", [
    ("hermes", "no tools here, just words"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}'),  # cut off: no closing tag
    ("hermes", '<tool_call>{"name": "f", "arguments": {x: 1}}</tool_call>'),  # not JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> and then some words'),
    ("llama3_json", "The weather is fine."),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}'),
    ("llama3_json", '{"title": "not a call"}'),
    ("mistral", "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": {\"x\": 1}"),
    ("mistral", "[TOOL_CALLS]f[ARGS]{not json"),
    ("mistral", "plain text"),
])
def test_malformed_output_is_plain_content(parser, text):
    assert tool_parsers.parse(parser, text) == (text, [])


def _plan(mode: str, parser: str = "hermes", name: str | None = None) -> ToolPlan:
    return ToolPlan([], mode, name, True, parser, {"f": {"type": "object"}})


def test_stream_holds_back_a_marker_split_over_pieces_and_sends_the_calls_at_the_end():
    stream = ToolStream(_plan("auto"))
    sent = []
    for piece in ["Sure", ". <tool", "_ca", 'll>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']:
        sent += stream.feed(piece)
    assert "".join(d["content"] for d in sent) == "Sure. "
    tail, finish = stream.finish("stop")
    assert finish == "tool_calls" and tail[0]["tool_calls"][0]["function"]["name"] == "f"
    assert tail[0]["tool_calls"][0]["index"] == 0 and tail[0]["tool_calls"][0]["id"].startswith("call_")


def test_stream_of_a_false_start_gives_the_text_back_as_content():
    stream = ToolStream(_plan("auto"))
    sent = stream.feed("a <tool") + stream.feed("_call> oops")
    tail, finish = stream.finish("stop")
    assert finish == "stop" and "".join(d["content"] for d in sent + tail) == "a <tool_call> oops"


def test_stream_of_a_named_function_sends_arguments_as_they_come():
    stream = ToolStream(_plan("named", name="f"))
    first, second = stream.feed('{"a"'), stream.feed(": 1}")
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a"'}
    assert second == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert stream.finish("stop") == ([], "tool_calls")
