"""Tool calling with the `openai` package, unchanged, against tiny random Llama and Qwen2 models whose chat
template (written here) renders `tools`, assistant `tool_calls` and `tool` results: `required` and a
named function return calls whose arguments validate against the function's schema, streamed and not;
`auto` reads the model's own format with the parser its config names (the output is steered into that
format with a regex, since a random model never writes it by itself); `none` leaves it as content; a
conversation with a tool result renders as the template says."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is part of the test extra")
jinja2 = pytest.importorskip("jinja2")

from tests import llm_builders  # noqa: E402
from tests.conftest import RunningServer  # noqa: E402

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}={{ m.content }}\n"
    "{% elif m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>{{ c.function.name }} "
    "{{ c.function.arguments.city }}</tool_call>{% endfor %}\n"
    "{% else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                            "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet", "pst"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "weather in oslo?"}]
HERMES_REGEX = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,5}", "unit": "c"\}\}</tool_call>'


def _model(repo, name: str, family: str, parser: str | None = None) -> None:
    folder = llm_builders.build_model(repo / name / "1", family)
    config = llm_builders.llm_config()
    if parser:
        config += f"parameters: {{tool_call_parser: {{string_value: '{parser}'}}}}\n"
    (repo / name / "config.yaml").write_text(config)
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    _model(repo, "qwen2", "qwen2")  # hermes, the default
    _model(repo, "llama", "llama", "llama3_json")
    _model(repo, "mistral", "mistral", "mistral")
    server = RunningServer(repo)
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    yield server, client
    server.stop()


def check(call) -> dict:
    assert call.type == "function" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("model", ["qwen2", "llama"])
def test_required_returns_valid_calls(env, model):
    _, client = env
    names = set()
    for seed in range(4):
        answer = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice.message.content
        check(choice.message.tool_calls[0])
        names.add(choice.message.tool_calls[0].function.name)
    assert len(names) == 2  # the model's own choice of function, each valid
    calls = []
    for seed in range(6):  # parallel calls: a random model ends the list when its draw says so (or runs out of tokens)
        choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                temperature=1.0, seed=seed, max_tokens=400).choices[0]
        if choice.finish_reason == "tool_calls":
            calls.append(choice.message.tool_calls)
            for call in choice.message.tool_calls:
                check(call)
        else:
            assert choice.finish_reason == "length" and choice.message.content.startswith("[{")
    assert any(len(c) > 1 for c in calls)


@pytest.mark.parametrize("model", ["qwen2", "llama"])
def test_named_function_returns_its_call(env, model):
    _, client = env
    for seed in range(3):
        answer = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=120,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        check(call)


def _streamed(client, **kwargs):
    """Assemble a streamed answer the way SDK users do: content joined, tool call deltas merged by index."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function is not None:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_assemble_to_the_whole_answer(env, tool_choice):
    _, client = env
    kwargs = dict(model="qwen2", messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=7,
                  max_tokens=200)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish = _streamed(client, **kwargs)
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"] for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


def test_auto_parses_the_models_own_format_streamed_and_not(env):
    _, client = env
    kwargs = dict(model="qwen2", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=3, max_tokens=250,
                  extra_body={"guided_regex": HERMES_REGEX})
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and check(call)["unit"] == "c"
    content, calls, finish = _streamed(client, **kwargs)
    assert (content, finish) == ("Sure. ", "tool_calls")  # the marker and the call never leak into content
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]


def test_none_leaves_the_text_as_content(env):
    _, client = env
    choice = client.chat.completions.create(model="qwen2", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                            temperature=1.0, seed=3, max_tokens=250,
                                            extra_body={"guided_regex": HERMES_REGEX}).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(HERMES_REGEX, choice.message.content)


@pytest.mark.parametrize("model, regex, expected", [
    ("llama", r'\{"name": "get_time", "parameters": \{"zone": "(utc|cet)"\}\}', ["get_time"]),
    ("mistral", r'\[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "pst"\}\}, '
                r'\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,4}", "unit": "f"\}\}\]', ["get_time", "get_weather"]),
])
def test_the_parser_the_config_names_is_used(env, model, regex, expected):
    _, client = env
    choice = client.chat.completions.create(model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1,
                                            max_tokens=250, extra_body={"guided_regex": regex}).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == expected
    for call in choice.message.tool_calls:
        check(call)
    content, calls, finish = _streamed(client, model=model, messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1,
                                       max_tokens=250, extra_body={"guided_regex": regex})
    assert finish == "tool_calls" and [c["name"] for c in calls] == expected and content == ""


def test_a_tool_result_round_trips_through_the_template(env):
    _, client = env
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 degrees"}]
    answer = client.chat.completions.create(model="qwen2", messages=conversation, tools=TOOLS, temperature=0,
                                            max_tokens=12, extra_body={"ignore_eos": True})
    rendered = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE).render(
        bos_token="<s>", tools=TOOLS, add_generation_prompt=True,
        messages=MESSAGES + [{"role": "assistant", "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "oslo"}}}]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "rain, 7 degrees"}])
    assert "<tool_call>get_weather oslo</tool_call>" in rendered and "<|tool|>call_1=rain, 7 degrees" in rendered
    plain = client.completions.create(model="qwen2", prompt=rendered, temperature=0, max_tokens=12,
                                      extra_body={"ignore_eos": True})
    assert answer.usage.prompt_tokens == plain.usage.prompt_tokens
    assert answer.choices[0].message.content == plain.choices[0].text


@pytest.mark.parametrize("extra, named", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "names function 'nope'"),
    (dict(tool_choice="required"), "'tool_choice' needs 'tools'"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": "get_time"}), "names function None"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": ["get_time"]}}), "names function ['get_time']"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "'tool_choice' must be"),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools[0] must be"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "drop 'response_format'"),
])
def test_bad_tool_requests_are_400(env, extra, named):
    _, client = env
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=5, **extra)
    assert named in str(caught.value)


def test_fuzzed_tool_and_format_fields_get_200_or_400_never_500(env):
    """Any JSON in the new fields (tools, tool_choice, parallel_tool_calls, response_format, guided_*,
    structured_outputs, tool messages) is answered or refused with a 400, and the server keeps serving."""
    import httpx
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    server, client = env
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6),
                     st.sampled_from(["function", "get_time", "auto", "required", "none", "json_object", "json_schema",
                                      "object", "a(", "[a-c]{2}", '{"type": "object"}']))
    value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(
                                                           ["type", "function", "name", "parameters", "schema",
                                                            "json_schema", "json", "regex", "choice", "arguments"]),
                                                           inner, max_size=3)), max_leaves=8)
    shaped = {  # each field also in the shape it should have, with anything inside
        "tools": st.one_of(value, st.just(TOOLS), st.lists(st.fixed_dictionaries({"type": st.just("function"),
                                                                                  "function": value}), max_size=2)),
        "tool_choice": st.one_of(value, st.fixed_dictionaries({"type": st.just("function"), "function": value})),
        "response_format": st.one_of(value, st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": value})),
    }
    fields = st.fixed_dictionaries({}, optional={key: shaped.get(key, value) for key in (
        "tools", "tool_choice", "parallel_tool_calls", "response_format", "guided_json", "guided_regex", "guided_choice",
        "structured_outputs")})
    extra_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["tool", "assistant"]),
                                                     "content": st.one_of(st.none(), st.text(max_size=5)),
                                                     "tool_calls": value, "tool_call_id": value}), max_size=2)
    statuses = []
    with httpx.Client(base_url=server.http_url, timeout=60) as http:
        @settings(max_examples=100, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(fields, extra_messages)
        def check(extra, messages):
            body = {"model": "qwen2", "messages": MESSAGES + messages, "max_tokens": 2, **extra}
            answer = http.post("/v1/chat/completions", json=body)
            statuses.append(answer.status_code)
            assert answer.status_code in (200, 400), (body, answer.text)

        check()
    assert 200 in statuses and 400 in statuses
    assert client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=2).choices[0].message.content is not None
    assert "Traceback" not in server.output
