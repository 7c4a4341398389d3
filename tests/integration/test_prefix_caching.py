"""Prefix caching through the real server: requests sharing a prompt prefix reuse its KV blocks and still
decode exactly as transformers' greedy decoding does, whatever shares, preempts, cancels or evicts."""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from tests import kserve, llm_builders
from tests.conftest import RunningServer, until_preempted

SYSTEM = [random.Random(5).randrange(2, 300) for _ in range(40)]  # ten 4-token blocks, two and a half of 16
LONG = 60_000  # tokens: minutes of decoding on any CPU, so the stream is still running when it is cancelled


def shared_prompts(seed: int, count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(SYSTEM[: rng.randrange(20, 41)] + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 12))],
             rng.randrange(1, 16)) for _ in range(count)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for family in ("llama", "qwen2", "mistral"):
        llm_builders.build_model(repo / family / "1", family)
        (repo / family / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    llama = repo / "llama" / "1"
    shutil.copytree(llama, repo / "tight" / "1")  # shared prefixes in a pool too small for everyone at once
    (repo / "tight" / "config.yaml").write_text(llm_builders.llm_config(num_kv_blocks=40, max_num_batched_tokens=64))
    shutil.copytree(llama, repo / "small" / "1")  # a pool that must evict cached prefixes to go on
    (repo / "small" / "config.yaml").write_text(llm_builders.llm_config(num_kv_blocks=24, max_num_seqs=1))
    shutil.copytree(llama, repo / "nocache" / "1")
    (repo / "nocache" / "config.yaml").write_text(llm_builders.llm_config(enable_prefix_caching=False))
    llm_builders.build_model(repo / "long" / "1", "llama", max_positions=LONG + 64)
    (repo / "long" / "config.yaml").write_text(llm_builders.llm_config(block_size=16, num_kv_blocks=LONG // 16 + 16))
    server = RunningServer(repo)
    yield server, repo
    server.stop()


def request(model, prompt, max_tokens):
    return gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                               sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def generate(server, model, prompt, max_tokens) -> list[int]:
    responses = gen_grpc.GenerationStub(server.channel).Generate(request(model, prompt, max_tokens), timeout=120)
    return [t for r in responses for t in r.token_ids]


def run_concurrently(server, model, cases) -> list[list[int]]:
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda c: generate(server, model, *c), cases))


def hits(server, model) -> float:
    return server.metric("ferry_prefix_cache_hit_tokens_total", model=model) or 0.0


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral"])
def test_shared_prefixes_are_reused_and_outputs_match_transformers_greedy(env, model):
    server, repo = env
    first, *rest = shared_prompts(1, 9)
    assert generate(server, model, *first) == llm_builders.reference_greedy(repo / model / "1", *first)
    before = hits(server, model)
    results = run_concurrently(server, model, rest)
    for (prompt, n), got in zip(rest, results):
        assert got == llm_builders.reference_greedy(repo / model / "1", prompt, n)
    assert hits(server, model) - before >= 8 * 20  # each found at least the 5 blocks of the shortest prefix
    assert 0 < server.metric("ferry_prefix_cache_hit_rate_tokens", model=model) < 1
    server.wait_for_metric("ferry_kv_blocks_used", 0, model=model)
    assert server.metric("ferry_kv_blocks_cached", model=model) >= 10  # idle, kept for the next request


def test_preemption_with_shared_blocks_loses_nothing(env):
    server, repo = env
    cases = shared_prompts(2, 12)
    results = until_preempted(server, "tight", lambda: run_concurrently(server, "tight", cases))
    assert hits(server, "tight") > 0
    for (prompt, n), got in zip(cases, results):
        assert got == llm_builders.reference_greedy(repo / "tight" / "1", prompt, n)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="tight")


def test_evicted_prefixes_are_recomputed_correctly(env):
    server, repo = env
    rng = random.Random(3)
    first = (SYSTEM + [7], 4)
    assert generate(server, "small", *first) == llm_builders.reference_greedy(repo / "small" / "1", *first)
    for _ in range(3):  # other prompts fill the pool: the first prompt's idle blocks must be reused
        generate(server, "small", [rng.randrange(2, 300) for _ in range(60)], 4)
    assert server.metric("ferry_prefix_cache_evictions_total", model="small") > 0
    again = (SYSTEM + [9], 6)
    assert generate(server, "small", *again) == llm_builders.reference_greedy(repo / "small" / "1", *again)


def test_cancelling_one_of_two_sequences_sharing_a_prefix_leaves_the_other_exact(env):
    server, repo = env
    stub = gen_grpc.GenerationStub(server.channel)
    long = stub.Generate(request("long", SYSTEM + [3], LONG - 64), timeout=600)
    next(long)  # running, holding the prefix's blocks; it cannot finish before it is cancelled
    before = hits(server, "long")
    other = stub.Generate(request("long", SYSTEM + [4, 5], 48), timeout=120)
    got = [t for t in next(other).token_ids]  # admitted next to the long stream, sharing its first 2 blocks
    long.cancel()
    got += [t for r in other for t in r.token_ids]
    assert got == llm_builders.reference_greedy(repo / "long" / "1", SYSTEM + [4, 5], 48)
    assert hits(server, "long") - before == 32
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="long")
    server.wait_for_metric("ferry_generation_running", 0, model="long")


def test_prefix_caching_can_be_turned_off(env):
    server, repo = env
    cases = [(SYSTEM + [i], 3) for i in (2, 3)]
    for prompt, n in cases:
        assert generate(server, "nocache", prompt, n) == llm_builders.reference_greedy(repo / "nocache" / "1", prompt, n)
    assert hits(server, "nocache") == 0 and server.metric("ferry_kv_blocks_cached", model="nocache") == 0
    config = kserve.stub(server.channel).ModelConfig(pb.ModelConfigRequest(name="nocache")).config
    assert config.generation.HasField("enable_prefix_caching") and not config.generation.enable_prefix_caching
