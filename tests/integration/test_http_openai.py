"""The official `openai` package, unchanged, against Ferry's OpenAI-compatible API, and Triton's
generate extension over HTTP: token for token against transformers' greedy decoding, exact usage,
chat templates, errors in OpenAI's shape, and a client that leaves mid-stream freeing its KV blocks."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")

from tokenizers import Tokenizer  # noqa: E402

from protos import generate_pb2 as gen  # noqa: E402
from protos import generate_pb2_grpc as gen_grpc  # noqa: E402
from tests import llm_builders  # noqa: E402
from tests.conftest import RunningServer  # noqa: E402

ENDLESS = 20_000  # tokens: far more than any machine decodes before the test disconnects
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llama = llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config())
    shutil.copytree(llama, repo / "plain" / "1")  # the same model without a chat template
    (repo / "plain" / "config.yaml").write_text(llm_builders.llm_config())
    (llama / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    llm_builders.build_model(repo / "endless" / "1", "llama", max_positions=ENDLESS + 8)
    (repo / "endless" / "config.yaml").write_text(
        llm_builders.llm_config(block_size=16, num_kv_blocks=ENDLESS // 16 + 2, max_num_seqs=1))
    server = RunningServer(repo)
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield server, client, llama
    server.stop()


def greedy_text(server, folder, prompt_ids: list[int], n: int) -> str:
    """The text of transformers' greedy tokens as Ferry streams it: the gRPC Generate call's tokens are
    checked equal to the reference, and its text (detokenized incrementally, so a character split across
    tokens reads the same as over HTTP) is what the HTTP answers must equal."""
    request = gen.GenerateRequest(model_name=folder.parent.name, token_ids=gen.TokenIds(ids=prompt_ids),
                                  sampling=gen.SamplingParams(max_tokens=n, ignore_eos=True))
    responses = list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))
    assert [t for r in responses for t in r.token_ids] == llm_builders.reference_greedy(folder, prompt_ids, n)
    return "".join(r.text for r in responses)


def test_models_lists_generation_models(env):
    _, client, _ = env
    assert sorted(m.id for m in client.models.list().data) == ["endless", "llama", "plain"]


def test_completions_match_greedy_streamed_and_not(env):
    server, client, llama = env
    prompt = [5, 17, 42, 99, 7, 3]
    expected = greedy_text(server, llama, prompt, 12)
    whole = client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (6, 12, 18)
    chunks = list(client.completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == 6


def test_chat_renders_the_template_and_matches_greedy(env):
    server, client, llama = env
    messages = [{"role": "system", "content": "go"}, {"role": "user", "content": "ferry"}]
    rendered = "<s><|system|>go\n<|user|>ferry\n<|assistant|>"
    prompt_ids = Tokenizer.from_file(str(llama / "tokenizer.json")).encode(rendered).ids
    assert prompt_ids[0] == 0  # the template's bos_token became the special token, as Hugging Face renders it
    expected = greedy_text(server, llama, prompt_ids, 10)  # gRPC's tokens equal transformers' greedy ones
    whole = client.chat.completions.create(model="llama", messages=messages, max_completion_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 10
    stream = list(client.chat.completions.create(model="llama", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    assert stream[-1].choices[0].finish_reason == "length"


def test_grpc_generate_takes_a_chat_prompt_rendered_as_chat_completions_renders_it(env):
    server, client, llama = env
    messages = [{"role": "system", "content": "go"}, {"role": "user", "content": "ferry"}]
    prompt_ids = Tokenizer.from_file(str(llama / "tokenizer.json")).encode("<s><|system|>go\n<|user|>ferry\n<|assistant|>").ids
    stub = gen_grpc.GenerationStub(server.channel)
    chat = gen.ChatPrompt(messages=[gen.ChatMessage(**m) for m in messages])
    responses = list(stub.Generate(gen.GenerateRequest(model_name="llama", chat=chat, sampling=gen.SamplingParams(
        max_tokens=10, ignore_eos=True)), timeout=120))
    assert [t for r in responses for t in r.token_ids] == llm_builders.reference_greedy(llama, prompt_ids, 10)
    assert responses[-1].usage.prompt_tokens == len(prompt_ids) and responses[-1].model_version == "1"
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert "".join(r.text for r in responses) == whole.choices[0].message.content
    no_prompt = gen.ChatPrompt(messages=[gen.ChatMessage(role="user", content="ferry")], add_generation_prompt=False)
    last = list(stub.Generate(gen.GenerateRequest(model_name="llama", chat=no_prompt,
                                                  sampling=gen.SamplingParams(max_tokens=1)), timeout=120))[-1]
    assert last.usage.prompt_tokens == len(Tokenizer.from_file(str(llama / "tokenizer.json")).encode("<s><|user|>ferry\n").ids)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(gen.GenerateRequest(model_name="plain", chat=chat), timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in info.value.details()


def test_errors_come_in_openais_shape(env):
    _, client, _ = env
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "hi"}])
    assert "chat template" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="llama", prompt="hi", temperature=-1)
    assert "temperature" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # what n and best_of cannot do is a 400, never a 5xx
        client.completions.create(model="llama", prompt="hi", n=3, best_of=2)
    assert "'best_of' (2) must be greater than or equal to 'n' (3)" in info.value.message


def post(server, path: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(server.http_url + path, data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_triton_generate_and_generate_stream(env):
    server, _, llama = env
    prompt = "the ferry leaves"
    ids = Tokenizer.from_file(str(llama / "tokenizer.json")).encode(prompt).ids
    expected = greedy_text(server, llama, ids, 8)
    body = {"text_input": prompt, "max_tokens": 8, "parameters": {"temperature": 0, "ignore_eos": True}}
    status, answer = post(server, "/v2/models/llama/generate", body)
    assert status == 200 and json.loads(answer)["text_output"] == prompt + expected  # the prompt in front, as Triton's vLLM backend
    status, answer = post(server, "/v2/models/llama/generate_stream", body)
    events = [json.loads(line[len(b"data: "):]) for line in answer.split(b"\n\n") if line]
    assert status == 200 and "".join(e["text_output"] for e in events) == expected
    assert events[-1]["finish_reason"] == "length" and events[-1]["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8}
    status, answer = post(server, "/v2/models/llama/generate", {"text_input": prompt, "parameters": {"top_p": 2}})
    assert status == 400 and "top_p" in json.loads(answer)["error"]


def test_triton_generate_echoes_the_request_id(env):
    server, _, _ = env
    body = {"id": "42", "text_input": "a ferry", "max_tokens": 2, "parameters": {"ignore_eos": True}}
    status, answer = post(server, "/v2/models/llama/generate", body)
    assert status == 200 and json.loads(answer)["id"] == "42"
    status, answer = post(server, "/v2/models/llama/generate_stream", body)
    events = [json.loads(line[len(b"data: "):]) for line in answer.split(b"\n\n") if line]
    assert status == 200 and events and all(e["id"] == "42" for e in events)
    status, answer = post(server, "/v2/models/llama/generate", {**body, "id": ""})
    assert status == 200 and "id" not in json.loads(answer)  # an empty id is not echoed, as Triton


def test_client_leaving_mid_stream_frees_its_kv_blocks(env):
    server, client, _ = env
    stream = client.completions.create(model="endless", prompt=[3, 4, 5], max_tokens=ENDLESS - 8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))  # it is running and holds blocks; it cannot finish before the test leaves
    assert server.metric("ferry_kv_blocks_used", model="endless") > 0
    stream.close()  # the HTTP connection goes away
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="endless", timeout_s=60)
    server.wait_for_metric("nv_inference_request_failure", 1, model="endless", reason="CANCELED", timeout_s=60)
