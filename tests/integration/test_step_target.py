"""`generation.max_step_ms` through the real server: parsed, refused when bad, and applied. The server runs
under tests/fixed_step_cost.py, which charges each step 1 ms per token to the cost model whatever it
took, so the chunk sizes follow from the config alone (never from this machine's speed)."""

from __future__ import annotations

import random
import shutil
import threading

import grpc
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from tests import kserve, llm_builders
from tests.conftest import RunningServer

TARGET_MS = 16  # at 1 ms a token: 16 tokens a step, decodes included
LONG = 20_000  # tokens the decoding stream may produce: far more than the test takes before cancelling it


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llm_builders.build_model(repo / "bounded" / "1", "llama", max_positions=LONG + 512)
    blocks = (LONG + 512) // 16 + 64
    (repo / "bounded" / "config.yaml").write_text(llm_builders.llm_config(
        block_size=16, num_kv_blocks=blocks, max_step_ms=TARGET_MS, min_prefill_tokens=4))
    shutil.copytree(repo / "bounded" / "1", repo / "unbounded" / "1")
    (repo / "unbounded" / "config.yaml").write_text(llm_builders.llm_config(block_size=16, num_kv_blocks=blocks))
    for name, fields in (("negative", {"max_step_ms": -5}),
                         ("oversized", {"min_prefill_tokens": 64, "max_num_batched_tokens": 32})):
        shutil.copytree(repo / "bounded" / "1", repo / name / "1")
        (repo / name / "config.yaml").write_text(llm_builders.llm_config(**fields))
    server = RunningServer(repo, module="tests.fixed_step_cost")
    yield server
    server.stop()


def request(model, prompt, max_tokens):
    return gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                               sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def prompt_beside_a_decode(server, model: str, prompt: list[int]) -> list[int]:
    """Generate from `prompt` while another stream of the same model is decoding the whole time."""
    stub = gen_grpc.GenerationStub(server.channel)
    decoding = stub.Generate(request(model, [5, 6, 7, 8], LONG))
    first, finished = threading.Event(), threading.Event()

    def drain():
        try:
            for response in decoding:
                first.set()
                if response.finish_reason:
                    finished.set()
        except grpc.RpcError as err:  # cancelled below, once the prompt is done
            assert err.code() == grpc.StatusCode.CANCELLED, err
        first.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    assert first.wait(60), "the decoding stream never produced a token"
    tokens = [t for r in stub.Generate(request(model, prompt, 4), timeout=120) for t in r.token_ids]
    assert not finished.is_set(), "the decoding stream ended before the prompt was computed: give it more tokens"
    decoding.cancel()
    reader.join(30)
    server.wait_for_metric("ferry_generation_running", 0, timeout_s=60, model=model)  # no step after this
    return tokens


def step_counts(server, model: str) -> tuple[float, float]:
    """(steps, steps of at most TARGET_MS tokens) from the step-size histogram."""
    return (server.metric("ferry_generation_step_tokens_count", model=model),
            server.metric("ferry_generation_step_tokens_bucket", model=model, le=f"{float(TARGET_MS)}"))


def test_prompt_chunks_beside_decodes_keep_each_step_within_the_target(env):
    prompt = [random.Random(3).randrange(2, 300) for _ in range(200)]
    bounded = prompt_beside_a_decode(env, "bounded", prompt)
    total, within = step_counts(env, "bounded")
    assert total > 200 // (TARGET_MS - 1) and within == total  # 200 prompt tokens in chunks of at most 15
    unbounded = prompt_beside_a_decode(env, "unbounded", prompt)
    total, within = step_counts(env, "unbounded")
    assert within < total, (total, within)  # without a target the prompt goes in one step beside the decode
    assert bounded == unbounded  # chunking changes when tokens come, never which


@pytest.mark.parametrize("model, words", [
    ("negative", "field 'generation.max_step_ms' must be a number of milliseconds >= 0 (0: no target), got -5"),
    ("oversized", "field 'generation.min_prefill_tokens' is 64, more than generation.max_num_batched_tokens (32)"),
])
def test_bad_values_keep_the_model_from_loading_naming_the_field(env, model, words):
    stub = kserve.stub(env.channel)
    assert not stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=30).ready
    index = {m.name: m for m in stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30).models}
    assert index[model].state == "UNAVAILABLE" and words in index[model].reason, index[model]
