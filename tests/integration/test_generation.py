"""Streaming generation over gRPC, checked token for token against transformers' own greedy decoding."""

from __future__ import annotations

import json
import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from tests import kserve, llm_builders
from tests.conftest import RunningServer, until_preempted


ENDLESS = 60_000  # tokens: minutes of decoding on any CPU, against a 100 ms deadline


def requests_for(seed: int, count: int):
    rng = random.Random(seed)
    return [([rng.randrange(2, 300) for _ in range(rng.randrange(2, 40))], rng.randrange(1, 24)) for _ in range(count)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llama = llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    llm_builders.build_model(repo / "qwen" / "1", "qwen2")
    (repo / "qwen" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    llm_builders.build_model(repo / "mistral" / "1", "mistral")
    (repo / "mistral" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    shutil.copytree(llama, repo / "tight" / "1")  # same weights, a KV pool too small for everyone at once
    (repo / "tight" / "config.yaml").write_text(llm_builders.llm_config(num_kv_blocks=40, max_num_batched_tokens=64))
    shutil.copytree(llama, repo / "single" / "1")  # one sequence at a time: others must wait
    (repo / "single" / "config.yaml").write_text(llm_builders.llm_config(max_num_seqs=1, max_model_len=128))
    # One sequence at a time, and room for a generation far longer than any test waits: whatever the
    # machine's speed, a stream asked for ENDLESS tokens is still running when the test cancels it.
    llm_builders.build_model(repo / "endless" / "1", "llama", max_positions=ENDLESS + 8)
    (repo / "endless" / "config.yaml").write_text(
        llm_builders.llm_config(block_size=16, num_kv_blocks=ENDLESS // 16 + 2, max_num_seqs=1))
    prompt = [5, 17, 42, 99, 7]
    first = llm_builders.reference_greedy(llama, prompt, 1)[0]
    shutil.copytree(llama, repo / "eos" / "1")  # its end-of-sequence token is what the model says first
    (repo / "eos" / "1" / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    (repo / "eos" / "config.yaml").write_text(llm_builders.llm_config())
    builders_onnx = __import__("tests.builders", fromlist=["add_sub"])
    builders_onnx.add_sub(repo / "simple" / "1" / "model.onnx")
    server = RunningServer(repo)
    yield server, repo
    server.stop()


def stream(server, model, prompt=None, text=None, timeout_s=120, **sampling):
    request = gen.GenerateRequest(model_name=model, sampling=gen.SamplingParams(**sampling))
    if text is not None:
        request.text = text
    else:
        request.token_ids.ids.extend(prompt)
    return list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=timeout_s))


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.mark.parametrize("model", ["llama", "qwen", "mistral"])
def test_sixteen_concurrent_streams_match_transformers_greedy(env, model):
    server, repo = env
    cases = requests_for(1, 16)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda c: stream(server, model, c[0], max_tokens=c[1], ignore_eos=True), cases))
    for (prompt, n), responses in zip(cases, results):
        assert tokens(responses) == llm_builders.reference_greedy(repo / model / "1", prompt, n)
        final = responses[-1]
        assert final.finish_reason == "length" and final.usage.completion_tokens == n
        assert final.usage.prompt_tokens == len(prompt) and final.timings.total_ms >= final.timings.time_to_first_token_ms
        assert all(not r.finish_reason for r in responses[:-1])


def test_preemption_under_a_small_kv_pool_loses_nothing(env):
    server, repo = env
    cases = requests_for(2, 12)

    def round_():
        with ThreadPoolExecutor(12) as pool:
            return list(pool.map(lambda c: stream(server, "tight", c[0], max_tokens=c[1], ignore_eos=True), cases))

    results = until_preempted(server, "tight", round_)
    for (prompt, n), responses in zip(cases, results):
        assert tokens(responses) == llm_builders.reference_greedy(repo / "tight" / "1", prompt, n)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="tight")


def test_text_prompt_streams_whole_characters_and_stop_strings_cut_the_text(env):
    server, repo = env
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(repo / "llama" / "1" / "tokenizer.json"))
    responses = stream(server, "llama", text="ünïcödé wörds 🚢", max_tokens=24, ignore_eos=True)
    full = "".join(r.text for r in responses)
    assert full == tok.decode(tokens(responses))  # the deltas add up to exactly the decoded output
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop and full.index(stop) > 0  # the seeded model's text has a stop string to cut at
    cut = stream(server, "llama", text="ünïcödé wörds 🚢", max_tokens=24, ignore_eos=True, stop=[stop])
    assert cut[-1].finish_reason == "stop"
    assert "".join(r.text for r in cut) == full[: full.index(stop)]


def test_eos_and_stop_token_finish_reasons(env):
    server, _ = env
    eos = stream(server, "eos", [5, 17, 42, 99, 7], max_tokens=10)
    assert eos[-1].finish_reason == "eos" and len(tokens(eos)) == 1 and "".join(r.text for r in eos) == ""
    ignored = stream(server, "eos", [5, 17, 42, 99, 7], max_tokens=3, ignore_eos=True)
    assert ignored[-1].finish_reason == "length" and len(tokens(ignored)) == 3
    plain = tokens(stream(server, "llama", [8, 9, 10], max_tokens=6, ignore_eos=True))
    stopped = stream(server, "llama", [8, 9, 10], max_tokens=6, ignore_eos=True, stop_token_ids=[plain[2]])
    assert stopped[-1].finish_reason == "stop" and tokens(stopped) == plain[: plain.index(plain[2]) + 1]


def test_seeded_sampling_is_reproducible_whatever_the_batch(env):
    server, _ = env
    args = dict(max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tokens(stream(server, "llama", [3, 4, 5], **args))
    with ThreadPoolExecutor(6) as pool:
        crowd = list(pool.map(lambda i: tokens(stream(server, "llama", [3, 4, 5] if i == 0 else [i + 10, 7],
                                                           **{**args, "seed": 1234 if i == 0 else i})), range(6)))
    assert crowd[0] == alone
    other_seeds = {tuple(tokens(stream(server, "llama", [3, 4, 5], **{**args, "seed": s}))) for s in (1, 2, 3)}
    assert len(other_seeds | {tuple(alone)}) > 1  # sampling does depend on the seed


def test_cancelled_stream_and_expired_deadline_free_their_blocks(env):
    server, _ = env
    stub = gen_grpc.GenerationStub(server.channel)
    long = stub.Generate(gen.GenerateRequest(model_name="endless", token_ids=gen.TokenIds(ids=[3, 4, 5]),
                                             sampling=gen.SamplingParams(max_tokens=ENDLESS - 8, ignore_eos=True)),
                         timeout=600)
    next(long)  # it is running and holds blocks, and it cannot finish before the test cancels it
    assert server.metric("ferry_kv_blocks_used", model="endless") > 0
    waiting = gen.GenerateRequest(model_name="endless", token_ids=gen.TokenIds(ids=[6, 7]), timeout_us=100_000,
                                  sampling=gen.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(waiting, timeout=60))  # only one sequence runs at a time: this one waits, then expires
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert server.metric("ferry_generation_running", model="endless") == 1  # the long stream still runs
    long.cancel()
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="endless")
    server.wait_for_metric("nv_inference_request_failure", 1, model="endless", reason="CANCELED")
    assert server.metric("ferry_generation_running", model="endless") == 0


def test_errors_and_kserve_views_of_a_generation_model(env):
    server, _ = env
    with pytest.raises(grpc.RpcError) as info:
        stream(server, "single", list(range(2, 140)), max_tokens=4)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        stream(server, "nope", [1, 2])
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as info:
        stream(server, "simple", [1, 2])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a generation model" in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        kserve.infer(server.channel, "llama", {"text_input": np.array([b"hi"], dtype=object)})
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "Generate" in info.value.details()
    api = kserve.stub(server.channel)
    states = {m.name: m.state for m in api.RepositoryIndex(pb.RepositoryIndexRequest()).models}
    assert states["llama"] == "READY" and states["qwen"] == "READY"
    meta = api.ModelMetadata(pb.ModelMetadataRequest(name="llama"))
    assert meta.platform == "ferry_llm"
    assert [t.name for t in meta.inputs] == ["text_input", "stream", "sampling_parameters", "exclude_input_in_output", "max_tokens"]
    config = api.ModelConfig(pb.ModelConfigRequest(name="tight")).config
    assert config.generation.num_kv_blocks == 40 and config.parameters["num_kv_blocks"].string_value == "40"
    assert config.model_transaction_policy.decoupled  # what Triton clients read to know it streams
    stats = api.ModelStatistics(pb.ModelStatisticsRequest(name="llama")).model_stats[0]
    assert stats.inference_stats.success.count > 0 and stats.execution_count > 0


def test_bfloat16_keeps_rotary_frequencies_in_float32(env):
    _, repo = env
    import torch

    from protos import model_config_pb2 as mc
    from server.backends.base import Device
    from server.backends.llm.engine import LLMBackend
    from server.backends.llm.llama import rope_inv_freq

    config = mc.ModelConfig(name="llama", backend="llm")
    config.generation.num_kv_blocks, config.generation.dtype = 8, "bfloat16"
    backend = LLMBackend(config, repo / "llama" / "1" / "config.json", Device("cpu"))
    backend.load()
    assert backend.model.lm_head.weight.dtype == torch.bfloat16
    assert backend.model.inv_freq.dtype == torch.float32
    assert torch.equal(backend.model.inv_freq, rope_inv_freq(backend.args))
