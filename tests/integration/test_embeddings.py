"""Embedding models (sentence-transformers folders) through every door: /v1/embeddings with the openai SDK
(float and base64), KServe infer with tritonclient (gRPC and HTTP) and `ferry batch`, each vector equal to
`SentenceTransformer.encode` for the same text; mixed-length concurrent texts batched together and each equal
to itself sent alone; over-long input refused naming the limit, or truncated when the request asks."""

from __future__ import annotations

import base64
import importlib.util
import json
import random
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sentence_transformers", reason="sentence-transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")
if importlib.util.find_spec("tritonclient") is None:  # imported only by embedding_calls.py, in its own process
    pytest.skip(reason="tritonclient[grpc,http] is not installed (it is part of the test extra)", allow_module_level=True)

from protos import grpc_service_pb2 as pb  # noqa: E402
from tests import embedding_builders, kserve  # noqa: E402
from tests.conftest import ROOT, RunningServer  # noqa: E402

ATOL = 1e-5
MAX_SEQ = 64  # the models' max_seq_length (sentence_bert_config.json)
DIM = 64
# name -> (pooling, normalize, config): one folder with no config at all (recognised by its modules.json)
TORCH = 'parameters { key: "encoder_runtime" value { string_value: "torch" } }\n'
ORT = 'parameters { key: "encoder_runtime" value { string_value: "onnxruntime" } }\n'
MODELS = {
    "mean_norm": ("mean", True, None),
    "mean_raw": ("mean", False, 'backend: "embedding"\n' + ORT),
    "cls_norm": ("cls", True, 'backend: "embedding"\nmax_batch_size: 8\n'),
    "cls_raw": ("cls", False, 'backend: "embedding"\n' + TORCH),
    # folders that carry their own ONNX export (onnx/model.onnx): one of this encoder, one of another's weights
    "shipped": ("mean", True, None),
    "shipped_wrong": ("cls", True, None),
    # a long window: concurrent texts surely meet in the queue (a full batch or budget still leaves at once)
    "windowed": ("mean", True, 'backend: "embedding"\nmax_batch_size: 16\n'
                               "dynamic_batching { max_queue_delay_microseconds: 300000 }\n"
                               "binpack_batching { max_batch_cost: 2048 }\n"),
}


def texts(count: int, seed: int, longest: int = 40) -> list[str]:
    rng = random.Random(seed)
    words = embedding_builders.WORDS + ["xyzzy", "q7", "tokenizers!", "long-tailed"]
    return [" ".join(rng.choice(words) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, longest]))) for _ in range(count)]


TEXTS = texts(12, seed=1)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for seed, (name, (pooling, normalize, config)) in enumerate(MODELS.items()):
        embedding_builders.build_encoder(repo / name / "1", pooling, normalize, seed=seed, hidden=DIM,
                                         max_seq_length=MAX_SEQ)
        if config is not None:
            (repo / name / "config.pbtxt").write_text(config)
    embedding_builders.ship_onnx_export(repo / "shipped" / "1")
    embedding_builders.ship_onnx_export(repo / "shipped_wrong" / "1", weights_from=repo / "mean_norm" / "1")
    server = RunningServer(repo, timeout_s=300)  # five encoders load with transformers: slow on a busy machine
    client = openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="unused", max_retries=0)
    yield repo, server, client
    server.stop()


def reference(env, name: str, items: list[str]) -> np.ndarray:
    return embedding_builders.reference(env[0] / name / "1", items)


def post(server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{server.http_url}/v1/embeddings", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("name", list(MODELS))
def test_openai_sdk_float_equals_sentence_transformers(env, name):
    _, _, client = env
    answer = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    got = np.array([d.embedding for d in sorted(answer.data, key=lambda d: d.index)], np.float32)
    want = reference(env, name, TEXTS)
    assert got.shape == (len(TEXTS), DIM)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    tokenizer = embedding_builders_tokenizer(env, name)
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)
    assert answer.model == name


def embedding_builders_tokenizer(env, name: str):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(env[0] / name / "1"))


@pytest.mark.parametrize("name", ["mean_norm", "cls_raw"])
def test_base64_is_little_endian_float32_and_the_sdk_default_decodes_it(env, name):
    _, server, client = env
    want = reference(env, name, TEXTS)
    status, body = post(server, {"model": name, "input": TEXTS, "encoding_format": "base64"})
    assert status == 200
    got = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in body["data"]])
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    sdk = client.embeddings.create(model=name, input=TEXTS)  # the SDK asks for base64 and decodes it itself
    np.testing.assert_allclose(np.array([d.embedding for d in sdk.data], np.float32), want, atol=ATOL, rtol=0)
    one = client.embeddings.create(model=name, input=TEXTS[3], encoding_format="float")  # a bare string
    np.testing.assert_allclose(np.array(one.data[0].embedding, np.float32), want[3], atol=ATOL, rtol=0)


def test_token_id_inputs_are_taken_as_given(env):
    _, _, client = env
    tokenizer = embedding_builders_tokenizer(env, "mean_raw")
    ids = [tokenizer(t)["input_ids"] for t in TEXTS[:4]]
    want = reference(env, "mean_raw", TEXTS[:4])
    many = client.embeddings.create(model="mean_raw", input=ids, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in many.data], np.float32), want, atol=ATOL, rtol=0)
    assert many.usage.prompt_tokens == sum(map(len, ids))
    one = client.embeddings.create(model="mean_raw", input=ids[2], encoding_format="float")
    np.testing.assert_allclose(np.array(one.data[0].embedding, np.float32), want[2], atol=ATOL, rtol=0)
    status, body = post(env[1], {"model": "mean_raw", "input": [[2, 10**6, 3]]})
    assert status == 400 and "vocabulary" in body["error"]["message"]


def test_dimensions_truncate_and_renormalise_only_a_normalising_model(env):
    _, server, client = env
    full = reference(env, "mean_norm", TEXTS[:3])
    cut = client.embeddings.create(model="mean_norm", input=TEXTS[:3], dimensions=16, encoding_format="float")
    got = np.array([d.embedding for d in cut.data], np.float32)
    want = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    raw = client.embeddings.create(model="mean_raw", input=TEXTS[:3], dimensions=16, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in raw.data], np.float32),
                               reference(env, "mean_raw", TEXTS[:3])[:, :16], atol=ATOL, rtol=0)
    status, body = post(server, {"model": "mean_norm", "input": "x", "dimensions": DIM + 1})
    assert status == 400 and f"1 to {DIM}" in body["error"]["message"]


def test_too_long_input_is_refused_naming_the_limit_or_truncated_when_asked(env):
    _, server, client = env
    long_text = " ".join(embedding_builders.WORDS * 4)  # ~100 tokens, every position different
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="cls_norm", input=["short one", long_text])
    assert f"{MAX_SEQ} tokens" in str(refused.value)
    # truncated to the model's length, a text is cut as sentence-transformers cuts it: the same vector
    want = reference(env, "cls_norm", [long_text])[0]
    for keep in (MAX_SEQ, -1):
        cut = client.embeddings.create(model="cls_norm", input=[long_text, "short one"], encoding_format="float",
                                       extra_body={"truncate_prompt_tokens": keep})
        np.testing.assert_allclose(cut.data[0].embedding, want, atol=ATOL, rtol=0)
        assert cut.usage.prompt_tokens == MAX_SEQ + 4  # "short one": [CLS] short one [SEP]
    # shorter: the tokenizer's own cut (first tokens, CLS ... SEP kept), equal to those ids sent as they are
    tokenizer = embedding_builders_tokenizer(env, "cls_norm")
    kept = tokenizer(long_text, truncation=True, max_length=10)["input_ids"]
    assert len(kept) == 10 and kept[-1] == tokenizer.sep_token_id
    cut = client.embeddings.create(model="cls_norm", input=long_text, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 10})
    alone = client.embeddings.create(model="cls_norm", input=kept, encoding_format="float")
    assert cut.usage.prompt_tokens == 10
    np.testing.assert_allclose(cut.data[0].embedding, alone.data[0].embedding, atol=ATOL, rtol=0)
    # token ids keep their last tokens (vLLM's rule for ids)
    ids = tokenizer(long_text)["input_ids"]
    tail = client.embeddings.create(model="cls_norm", input=[ids], encoding_format="float",
                                    extra_body={"truncate_prompt_tokens": 12})
    tail_alone = client.embeddings.create(model="cls_norm", input=[ids[-12:]], encoding_format="float")
    np.testing.assert_allclose(tail.data[0].embedding, tail_alone.data[0].embedding, atol=ATOL, rtol=0)
    for bad in (MAX_SEQ + 1, 0, "5"):
        status, body = post(server, {"model": "cls_norm", "input": "x", "truncate_prompt_tokens": bad})
        assert status == 400 and "truncate_prompt_tokens" in body["error"]["message"], body
    # over KServe: INVALID_ARGUMENT (400) naming the limit, or the parameter's truncation
    refused = tritonclient_calls(server, "cls_norm", ["short one", long_text])
    assert refused["grpc"]["status"] == "StatusCode.INVALID_ARGUMENT" and f"{MAX_SEQ} tokens" in refused["grpc"]["message"]
    assert refused["http"]["status"] == "400" and f"{MAX_SEQ} tokens" in refused["http"]["message"]
    truncated = tritonclient_calls(server, "cls_norm", [long_text], {"truncate_prompt_tokens": MAX_SEQ})
    for door in ("grpc", "http"):
        np.testing.assert_allclose(truncated[door]["vectors"][0], want, atol=ATOL, rtol=0)


def test_bad_bodies_are_400_and_other_kinds_refused(env):
    server = env[1]
    for body, words in [({"model": "mean_norm", "input": []}, "'input'"),
                        ({"model": "mean_norm", "input": [1, "a"]}, "'input'"),
                        ({"model": "mean_norm", "input": "a", "encoding_format": "int8"}, "encoding_format"),
                        ({"model": "mean_norm", "input": "a", "frobnicate": 1}, "unsupported"),
                        ({"input": "a"}, "'model'")]:
        status, answer = post(server, body)
        assert status == 400 and words in answer["error"]["message"], (body, answer)
    status, answer = post(server, {"model": "nope", "input": "a"})
    assert status == 404


def tritonclient_calls(server, name: str, items: list[str], parameters: dict | None = None) -> dict:
    """tritonclient's answers over gRPC and HTTP, from a process of their own (see embedding_calls.py)."""
    script = Path(__file__).with_name("embedding_calls.py")
    run = subprocess.run([sys.executable, str(script), server.address, server.http_address, name, json.dumps(items),
                          json.dumps(parameters or {})], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_kserve_infer_with_text_bytes_over_grpc_and_http(env):
    _, server, _ = env
    want = reference(env, "mean_norm", TEXTS[:6])
    answers = tritonclient_calls(server, "mean_norm", TEXTS[:6])
    for door in ("grpc", "http"):
        assert answers[door]["dtype"] == "float32"
        got = np.array(answers[door]["vectors"], np.float32)
        assert got.shape == (6, DIM)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    config = answers["config"]
    assert config["backend"] == "embedding"  # recognised from modules.json: the folder has no config file
    assert [(t["name"], t["data_type"]) for t in config["input"]] == [("text", "TYPE_STRING")]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [("embedding", [DIM])]


def test_models_lists_embedding_models(env):
    listed = {m.id for m in env[2].models.list().data}
    assert set(MODELS) <= listed


def test_a_folder_without_config_gets_narrow_length_buckets_and_a_token_budget(env):
    """The embedding backend's own batching: bin packing by token count with 16 learned buckets (padding is
    what an encoder's time follows), while a config's own binpack_batching keeps the policy's defaults."""
    stub = kserve.stub(env[1].channel)
    bare = stub.ModelConfig(pb.ModelConfigRequest(name="mean_norm")).config
    assert bare.HasField("binpack_batching") and bare.HasField("dynamic_batching")
    assert bare.binpack_batching.num_buckets == 16
    assert bare.binpack_batching.max_batch_cost == 16384
    assert bare.max_batch_size == 64
    own = stub.ModelConfig(pb.ModelConfigRequest(name="windowed")).config
    assert own.binpack_batching.max_batch_cost == 2048 and own.binpack_batching.num_buckets == 0


def test_encoder_runtime_onnx_on_a_cpu_unless_the_config_or_the_graph_says_otherwise(env):
    """`auto` (the default) runs the encoder's exported graph in ONNX Runtime on a CPU, a shipped export as it
    is; torch where the config asks, or where a shipped graph disagrees with transformers on the probe (the
    float test above checks every one of these models against sentence-transformers)."""
    stub = kserve.stub(env[1].channel)

    def runtime(name):
        params = stub.ModelConfig(pb.ModelConfigRequest(name=name)).config.parameters
        return params["encoder_runtime"].string_value, params["encoder_graph"].string_value

    assert runtime("mean_norm") == ("onnxruntime", "exported at load")
    assert runtime("mean_raw") == ("onnxruntime", "exported at load")
    assert runtime("cls_raw") == ("torch", "transformers")
    assert runtime("shipped") == ("onnxruntime", "onnx/model.onnx")
    assert runtime("shipped_wrong") == ("torch", "transformers")


def test_mixed_length_concurrent_requests_are_batched_and_each_equals_itself_alone(env):
    _, server, client = env
    mixed = texts(32, seed=7, longest=50)
    requests = [mixed[i:i + 1 + i % 3] for i in range(0, 32, 2)]  # 16 requests of 1-3 texts, lengths mixed

    def embed(items):
        return np.array([d.embedding for d in client.embeddings.create(
            model="windowed", input=items, encoding_format="float").data], np.float32)

    alone = [[embed([t])[0] for t in items] for items in requests]
    stub = kserve.stub(server.channel)
    before = stub.ModelStatistics(pb.ModelStatisticsRequest(name="windowed")).model_stats[0]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(embed, requests))
    after = stub.ModelStatistics(pb.ModelStatisticsRequest(name="windowed")).model_stats[0]
    for got, want in zip(together, alone):
        np.testing.assert_allclose(got, np.array(want), atol=ATOL, rtol=0)
    sent = sum(map(len, requests))
    texts_run = after.inference_count - before.inference_count
    batches = after.execution_count - before.execution_count
    assert texts_run == sent
    assert batches < len(requests), (batches, len(requests))  # fewer batches than client requests
    sizes = {s.batch_size: s.compute_infer.count for s in after.batch_stats}
    assert max(sizes) > 1
    np.testing.assert_allclose(np.concatenate(together), reference(env, "windowed", [t for r in requests for t in r]),
                               atol=ATOL, rtol=0)


def test_ferry_batch_lines_for_v1_embeddings(env, tmp_path):
    repo = env[0]
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
              "body": {"model": "cls_norm", "input": TEXTS[i:i + 3], "encoding_format": "float"}} for i in range(0, 9, 3)]
    lines.append({"custom_id": "bad", "method": "POST", "url": "/v1/embeddings",
                  "body": {"model": "cls_norm", "input": " ".join(["search"] * 100)}})
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = subprocess.run([sys.executable, "-m", "server", "batch", "-i", source, "-o", output, "--model-repository",
                          repo],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    answers = {r["custom_id"]: r for r in map(json.loads, output.read_text().splitlines())}
    want = reference(env, "cls_norm", TEXTS[:9])
    for i in range(0, 9, 3):
        response = answers[f"e{i}"]["response"]
        assert response["status_code"] == 200
        got = np.array([d["embedding"] for d in response["body"]["data"]], np.float32)
        np.testing.assert_allclose(got, want[i:i + 3], atol=ATOL, rtol=0)
    assert answers["bad"]["response"]["status_code"] == 400
