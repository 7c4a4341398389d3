"""Sampling parameters are checked once, by the generation runner's decoder, for both entrances.

A bad value fails its own request (INVALID_ARGUMENT on Generate, `error_message` on ModelStreamInfer)
before it is scheduled; good streams running beside it finish as if it had never been sent.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from tests import kserve, llm_builders
from tests.conftest import RunningServer

PROMPT = [5, 17, 42, 99, 7]
GOOD = dict(max_tokens=24, ignore_eos=True)

BAD_GENERATE = [
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=-0.5),
    dict(top_p=float("nan")), dict(top_p=1.5), dict(top_p=-0.1),
]
BAD_JSON = [
    '{"temperature": "hot"}', '{"temperature": NaN}', '{"temperature": Infinity}', '{"temperature": -1}',
    '{"top_p": 1.5}', '{"top_p": NaN}', '{"top_k": -1}', '{"top_k": 2.5}', '{"max_tokens": -3}',
    '{"max_tokens": "many"}', '{"seed": "x"}', '{"seed": 1.5}', '{"stop": 5}', '{"stop": [1]}',
    '{"stop_token_ids": ["a"]}', '{"stop_token_ids": 3}', '{"ignore_eos": "yes"}', '{"bogus": 1}',
    '[1, 2]', '{not json', '{"top_k": 100000000000000000000000}',
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=64))
    server = RunningServer(repo)
    yield server
    server.stop()


def generate(server, timeout_s=120, **sampling) -> list[gen.GenerateResponse]:
    request = gen.GenerateRequest(model_name="llama", sampling=gen.SamplingParams(**sampling))
    request.token_ids.ids.extend(PROMPT)
    return list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=timeout_s))


def vllm_request(request_id: str, sampling_json: str) -> object:
    return kserve.request("llama", {"text_input": np.array([b"the ferry leaves"], dtype=object),
                                    "sampling_parameters": np.array([sampling_json.encode()], dtype=object)},
                          request_id=request_id)


def test_generate_refuses_bad_sampling_while_good_streams_finish(server):
    with ThreadPoolExecutor(4 + len(BAD_GENERATE)) as pool:
        good = [pool.submit(generate, server, **GOOD, temperature=0.8, seed=i) for i in range(4)]
        bad = [pool.submit(generate, server, **GOOD, **params) for params in BAD_GENERATE]
        for params, future in zip(BAD_GENERATE, bad):
            with pytest.raises(grpc.RpcError) as info:
                future.result()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, params
        for future in good:
            responses = future.result()
            assert responses[-1].finish_reason == "length" and responses[-1].usage.completion_tokens == 24


def test_a_tiny_temperature_is_greedy_not_a_failure(server):
    greedy = [t for r in generate(server, **GOOD) for t in r.token_ids]
    tiny = generate(server, **GOOD, temperature=1e-40)
    assert [t for r in tiny for t in r.token_ids] == greedy and tiny[-1].finish_reason == "length"


def test_stream_infer_refuses_bad_sampling_parameters_and_serves_the_rest(server):
    requests = [vllm_request(f"bad-{i}", text) for i, text in enumerate(BAD_JSON)]
    requests += [vllm_request(f"good-{i}", json.dumps({"max_tokens": 12, "ignore_eos": True, "temperature": 0.7,
                                                        "seed": i})) for i in range(4)]
    requests.insert(3, vllm_request("tiny", json.dumps({"max_tokens": 12, "ignore_eos": True, "temperature": 1e-40})))
    responses = list(kserve.stub(server.channel).ModelStreamInfer(iter(requests), timeout=120))
    errors = {r.infer_response.id: r.error_message for r in responses if r.error_message}
    answers = {r.infer_response.id: r.infer_response for r in responses if not r.error_message}
    assert set(errors) == {f"bad-{i}" for i in range(len(BAD_JSON))}
    assert all("INTERNAL" not in m and "internal error" not in m for m in errors.values()), errors
    assert all("sampling" in m for m in errors.values()), errors
    assert set(answers) == {"tiny", *(f"good-{i}" for i in range(4))}
    for answer in answers.values():
        assert answer.parameters["finish_reason"].string_param == "length"
        assert answer.parameters["triton_final_response"].bool_param


def test_stream_infer_max_tokens_tensor_is_checked_too(server):
    request = kserve.request("llama", {"text_input": np.array([b"hi"], dtype=object),
                                       "max_tokens": np.array([-2], dtype=np.int32)}, request_id="neg")
    (response,) = list(kserve.stub(server.channel).ModelStreamInfer(iter([request]), timeout=120))
    assert "max_tokens" in response.error_message
