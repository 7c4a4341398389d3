"""Structured outputs with the `openai` package, unchanged, against tiny random models: whatever a model
that knows nothing would write, the grammar mask makes every answer valid (json_schema validated with
`jsonschema`, json_object parsed, regex and choice obeyed), streamed or not, `n` of them, cut by
max_tokens (reported as `length`), batched beside free requests that stay token-exact, preempted and
recomputed; and a constraint the engine cannot compile is a 400 before anything runs."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is part of the test extra")

from tests import llm_builders  # noqa: E402
from tests.conftest import RunningServer, until_preempted  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,10}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                                     "zip": {"type": "integer", "minimum": 1000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "score", "color", "tags", "address"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "describe a person as JSON"}]
MAX = 300


def _model(repo, name: str, family: str, **config) -> None:
    folder = llm_builders.build_model(repo / name / "1", family)
    (repo / name / "config.yaml").write_text(llm_builders.llm_config(**config))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    _model(repo, "llama", "llama")
    _model(repo, "qwen2", "qwen2")
    _model(repo, "tiny", "llama", num_kv_blocks=48)  # 192 tokens of KV: three long streams preempt
    # llama's weights (same family and seed), drafting from n-grams of its prompt and output
    _model(repo, "spec", "llama", speculative={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    server = RunningServer(repo)
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120, max_retries=0)
    yield server, client
    server.stop()


def valid(text: str, schema: dict = SCHEMA) -> dict:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


@pytest.mark.parametrize("model", ["llama", "qwen2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_answers_validate_over_seeds(env, model, temperature):
    _, client = env
    answers = []
    for seed in range(4):
        messages = [{"role": "user", "content": f"person number {seed}"}]  # greedy: the prompt varies instead
        answer = client.chat.completions.create(model=model, messages=messages, response_format=FORMAT,
                                                temperature=temperature, seed=seed, max_tokens=MAX)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        answers.append(valid(choice.message.content))
    assert len({json.dumps(a, sort_keys=True) for a in answers}) > 1  # the model's own choices, not one fixed answer


def test_same_answers_through_completions_and_vllm_fields(env):
    _, client = env
    for extra in ({"guided_json": SCHEMA}, {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        answer = client.completions.create(model="llama", prompt="a person:", temperature=1.0, seed=3, max_tokens=MAX,
                                           extra_body=extra)
        assert answer.choices[0].finish_reason == "stop"
        valid(answer.choices[0].text)


def test_free_text_of_this_model_is_not_json(env):
    """The control: without a constraint the same request gives text no JSON parser takes."""
    _, client = env
    answer = client.chat.completions.create(model="llama", messages=MESSAGES, temperature=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(answer.choices[0].message.content)


def test_json_object_parses(env):
    _, client = env
    for seed in range(3):
        answer = client.chat.completions.create(model="qwen2", messages=MESSAGES, response_format={"type": "json_object"},
                                                temperature=1.0, seed=seed, max_tokens=MAX)
        if answer.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(answer.choices[0].message.content), dict)
        else:  # a random model may nest without end; what it wrote is still an object's beginning
            assert answer.choices[0].message.content.startswith("{")


def test_regex_and_choice_are_obeyed(env):
    _, client = env
    for seed in range(4):
        answer = client.completions.create(model="llama", prompt="code:", temperature=1.0, seed=seed, max_tokens=20,
                                           extra_body={"guided_regex": r"[a-c]{3}-\d{2}"})
        assert re.fullmatch(r"[a-c]{3}-\d{2}", answer.choices[0].text), answer.choices[0].text
        picked = client.chat.completions.create(model="qwen2", messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=20,
                                                extra_body={"structured_outputs": {"choice": ["yes", "no", "ferry 🚢"]}})
        assert picked.choices[0].message.content in ("yes", "no", "ferry 🚢")
        assert picked.choices[0].finish_reason == "stop"


def test_grammar_is_obeyed(env):
    _, client = env
    grammar = 'start: "ls " DIR ("/" DIR)*\nDIR: /[a-z]{1,4}/'
    answer = client.completions.create(model="llama", prompt="$", temperature=1.0, seed=1, max_tokens=40,
                                       extra_body={"guided_grammar": grammar})
    text = answer.choices[0].text
    assert re.fullmatch(r"ls [a-z]{1,4}(/[a-z]{1,4})*", text if answer.choices[0].finish_reason == "stop"
                        else text + "a"), text


def test_streamed_deltas_make_one_valid_object(env):
    _, client = env
    for temperature in (0.0, 1.0):
        stream = client.chat.completions.create(model="llama", messages=MESSAGES, response_format=FORMAT, stream=True,
                                                temperature=temperature, seed=5, max_tokens=MAX)
        pieces, finish = [], None
        for chunk in stream:
            for choice in chunk.choices:
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        assert finish == "stop"
        whole = client.chat.completions.create(model="llama", messages=MESSAGES, response_format=FORMAT,
                                               temperature=temperature, seed=5, max_tokens=MAX)
        assert "".join(pieces) == whole.choices[0].message.content  # the same tokens, streamed
        valid("".join(pieces))


def test_n_choices_are_each_valid(env):
    _, client = env
    answer = client.chat.completions.create(model="qwen2", messages=MESSAGES, response_format=FORMAT, n=3,
                                            temperature=1.0, seed=11, max_tokens=MAX)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    values = [valid(c.message.content) for c in answer.choices]
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1


def test_logprobs_and_stop_strings_under_a_constraint(env):
    _, client = env
    answer = client.chat.completions.create(model="llama", messages=MESSAGES, response_format=FORMAT, temperature=0,
                                            max_tokens=MAX, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    assert all(c.logprob > -9999.0 for c in content)  # each chosen token is one the mask allowed
    cut = client.chat.completions.create(model="llama", messages=MESSAGES, response_format=FORMAT, temperature=0,
                                         max_tokens=MAX, stop=['"age"'])
    assert cut.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content.startswith(cut.choices[0].message.content)
    assert '"age"' not in cut.choices[0].message.content


def test_an_object_cut_by_max_tokens_reports_length(env):
    _, client = env
    answer = client.chat.completions.create(model="llama", messages=MESSAGES, response_format=FORMAT, temperature=0,
                                            max_tokens=6)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 6
    assert choice.message.content.startswith("{")
    with pytest.raises(ValueError):
        json.loads(choice.message.content)


def _stream_ids(client, **kwargs) -> tuple[str, list[int]]:
    answer = client.completions.create(model="llama", logprobs=0, **kwargs)
    return answer.choices[0].text, answer.choices[0].logprobs.tokens


def test_constrained_and_free_requests_share_steps_and_free_ones_are_unchanged(env):
    server, client = env
    free = dict(prompt="the ferry leaves", temperature=0, max_tokens=30, extra_body={"ignore_eos": True})
    alone = _stream_ids(client, **free)
    mixed_before = server.metric("ferry_structured_output_mixed_steps_total", model="llama") or 0.0
    requests = [free, dict(prompt="a person:", temperature=0, max_tokens=MAX, extra_body={"guided_json": SCHEMA})] * 3
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda kw: _stream_ids(client, **kw), requests))
    assert server.metric("ferry_structured_output_mixed_steps_total", model="llama") > mixed_before
    for i, (text, ids) in enumerate(results):
        if i % 2 == 0:
            assert ids == alone[1] and text == alone[0]
        else:
            valid(text)


def test_preempted_constrained_streams_stay_valid_and_equal_unpreempted_runs(env):
    server, client = env
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                         "minItems": 8, "maxItems": 8}},
              "required": ["items"], "additionalProperties": False}
    prompts = [f"list number {i} of the ferry" for i in range(3)]
    kwargs = dict(model="tiny", temperature=1.0, max_tokens=60, extra_body={"guided_json": schema})
    alone = [client.completions.create(prompt=p, seed=i, **kwargs).choices[0].text for i, p in enumerate(prompts)]

    def round_():
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda i: client.completions.create(prompt=prompts[i], seed=i, **kwargs).choices[0].text,
                                 range(3)))

    together = until_preempted(server, "tiny", round_)
    assert together == alone
    for text in together:
        if text.endswith("}"):
            valid(text, schema)


@pytest.mark.parametrize("extra, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}}, "cannot be compiled: Invalid type: objectx"),
    ({"guided_regex": "a(b"}, "the regex constraint cannot be compiled"),
    ({"guided_grammar": "start: nothing_defined"}, "nothing_defined"),
    ({"guided_json": "{not json"}, "'guided_json' is not valid JSON"),
    ({"guided_choice": []}, "'guided_choice' must be a non-empty list"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "one structured-output constraint"),
    ({"response_format": {"type": "yaml"}}, "'response_format.type' must be"),
])
def test_constraints_that_cannot_compile_are_400_and_run_nothing(env, extra, named):
    server, client = env
    before = server.metric("ferry_generation_step_tokens_count", model="qwen2") or 0.0
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=5, **extra) if "response_format" in extra \
            else client.chat.completions.create(model="qwen2", messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert named in str(caught.value)
    assert (server.metric("ferry_generation_step_tokens_count", model="qwen2") or 0.0) == before


def test_speculative_drafts_under_a_constraint_change_nothing(env):
    """Drafted rows get the mask of the state after the drafts before them; the answer equals the same
    model's without drafts, token for token."""
    server, client = env
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"enum": ["ab", "ba", "abab"]},
                                                         "minItems": 12, "maxItems": 12}},
              "required": ["items"], "additionalProperties": False}
    kwargs = dict(prompt='{"items": ["ab", "ba", "ab", "ba", "abab", "ab", "ba"]}', temperature=0, max_tokens=80, logprobs=0,
                  extra_body={"guided_json": schema})
    plain = client.completions.create(model="llama", **kwargs).choices[0]
    drafted = client.completions.create(model="spec", **kwargs).choices[0]
    assert server.metric("ferry_spec_decode_num_accepted_tokens_total", model="spec") > 0
    assert drafted.logprobs.tokens == plain.logprobs.tokens and drafted.text == plain.text
    valid(plain.text, schema)


def _generate(server, **sampling):
    from protos import generate_pb2 as gen, generate_pb2_grpc as gen_grpc

    request = gen.GenerateRequest(model_name="llama", text="a person:", sampling=gen.SamplingParams(**sampling))
    return list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))


def test_grpc_generate_takes_the_same_constraints(env):
    server, client = env
    responses = _generate(server, max_tokens=MAX, temperature=1.0, seed=4, json_schema=json.dumps(SCHEMA))
    assert responses[-1].finish_reason == "eos"
    text = "".join(r.text for r in responses)
    valid(text)
    same = client.completions.create(model="llama", prompt="a person:", temperature=1.0, seed=4, max_tokens=MAX,
                                     extra_body={"guided_json": SCHEMA})
    assert same.choices[0].text == text
    picked = "".join(r.text for r in _generate(server, max_tokens=20, temperature=1.0, seed=2, choice=["north", "south"]))
    assert picked in ("north", "south")
    code = "".join(r.text for r in _generate(server, max_tokens=20, temperature=1.0, seed=2, regex=r"[0-9]{4}"))
    assert re.fullmatch(r"[0-9]{4}", code)
    assert "".join(r.text for r in _generate(server, max_tokens=8, temperature=0, json_object=True)).startswith("{")
    import grpc

    with pytest.raises(grpc.RpcError) as caught:
        _generate(server, max_tokens=5, regex="a(")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        _generate(server, max_tokens=5, regex="a", choice=["a"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_triton_generate_endpoint_takes_constraints_as_parameters(env):
    server, _ = env
    import httpx

    url = f"{server.http_url}/v2/models/llama/generate"
    body = {"text_input": "a person:", "exclude_input_in_output": True, "parameters": {"max_tokens": MAX, "temperature": 1.0, "seed": 6,
                                                      "guided_json": json.dumps(SCHEMA)}}
    answer = httpx.post(url, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    valid(answer.json()["text_output"])
    body = {"text_input": "yes or no:", "exclude_input_in_output": True, "sampling_parameters": json.dumps({"structured_outputs": {"choice": ["yes", "no"]},
                                                                            "temperature": "1.0", "seed": "3"})}
    answer = httpx.post(url, json=body, timeout=120)
    assert answer.status_code == 200 and answer.json()["text_output"] in ("yes", "no"), answer.text
    bad = httpx.post(url, json={"text_input": "x", "parameters": {"guided_regex": "a("}}, timeout=120)
    assert bad.status_code == 400 and "regex" in bad.text


def test_ignore_eos_and_min_tokens_past_a_complete_output(env):
    """Once the output is complete only eos is allowed: ignore_eos goes on with eos (no text) to max_tokens,
    min_tokens past the end cannot be met by the grammar; neither fails the request, nor its neighbours."""
    _, client = env
    kwargs = dict(model="llama", prompt="x", temperature=0, max_tokens=30, extra_body={"guided_choice": ["yes", "no"]})
    alone = client.completions.create(**kwargs).choices[0].text
    answer = client.completions.create(n=2, **{**kwargs, "extra_body": {**kwargs["extra_body"], "ignore_eos": True}})
    assert [c.text for c in answer.choices] == [alone, alone] and answer.usage.completion_tokens == 60
    assert {c.finish_reason for c in answer.choices} == {"length"}
    held = client.completions.create(**{**kwargs, "extra_body": {**kwargs["extra_body"], "min_tokens": 5}}).choices[0]
    assert held.text == alone and held.finish_reason == "stop"
