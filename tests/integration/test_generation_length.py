"""A prompt plus an explicit max_tokens past max_model_len is refused with vLLM's numbers on every door:
400 on the OpenAI API (the `openai` package, unchanged) and on Triton's generate extension,
INVALID_ARGUMENT on the gRPC Generate RPC. A default max_tokens is still cut to fit."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")

from protos import generate_pb2 as gen  # noqa: E402
from protos import generate_pb2_grpc as gen_grpc  # noqa: E402
from tests import llm_builders  # noqa: E402
from tests.conftest import RunningServer  # noqa: E402

LIMIT = 64
PROMPT = list(range(5, 15))  # 10 tokens


def too_long(prompt: int, completion: int) -> str:
    return (f"This model's maximum context length is {LIMIT} tokens. However, you requested {prompt + completion} "
            f"tokens ({prompt} in the messages, {completion} in the completion).")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_model_len=LIMIT))
    server = RunningServer(repo)
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120)  # default retries
    yield server, client
    server.stop()


def test_openai_completions_answer_400_with_the_numbers(env):
    _, client = env
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="llama", prompt=PROMPT, max_tokens=60)
    assert info.value.status_code == 400 and too_long(10, 60) in info.value.message
    with pytest.raises(openai.BadRequestError):  # the newer name of the same field
        client.completions.create(model="llama", prompt=PROMPT, extra_body={"max_completion_tokens": 55})
    fits = client.completions.create(model="llama", prompt=PROMPT, max_tokens=LIMIT - 10, temperature=0)
    assert fits.usage.prompt_tokens == 10 and fits.usage.completion_tokens <= LIMIT - 10


def test_a_default_max_tokens_is_still_sized_to_fit(env):
    _, client = env
    near = list(range(5, 5 + LIMIT - 2))  # room for two tokens
    answer = client.completions.create(model="llama", prompt=near, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 2 and answer.choices[0].finish_reason == "length"


def test_grpc_generate_is_invalid_argument_with_the_numbers(env):
    server, _ = env
    request = gen.GenerateRequest(model_name="llama", token_ids=gen.TokenIds(ids=PROMPT),
                                  sampling=gen.SamplingParams(max_tokens=LIMIT))
    with pytest.raises(grpc.RpcError) as info:
        list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and too_long(10, LIMIT) in info.value.details()


def test_triton_generate_extension_answers_400(env):
    server, _ = env
    body = json.dumps({"text_input": "the ferry leaves", "max_tokens": LIMIT}).encode()
    request = urllib.request.Request(server.http_url + "/v2/models/llama/generate", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=120)
    assert info.value.code == 400
    message = json.loads(info.value.read())["error"]
    assert f"This model's maximum context length is {LIMIT} tokens. However, you requested" in message
    assert f"{LIMIT} in the completion" in message
