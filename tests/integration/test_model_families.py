"""The model families beyond plain Llama, through the real server, token for token against transformers'
greedy decoding: Qwen3 (per-head q/k norms), an explicit head_dim, sliding-window attention (every layer
in Mistral, the upper layers in Qwen2/Qwen3) past the window in prompt chunks and decodes, with shared
prefix blocks and under preemption, and Llama 3.x rope scaling.

The references run transformers with eager attention, whose mask applies the window explicitly; the
window tests also check that the reference without the window differs, so they prove the window matters.
"""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")

import torch

from protos import generate_pb2 as gen
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server.backends.llm import cpu_decode
from tests import llm_builders
from tests.conftest import RunningServer, until_preempted

WINDOW = 8
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
FAMILIES = {  # name: (family, config overrides); head_dim 24 or 32 where hidden_size // heads is 16
    "qwen3": ("qwen3", dict(head_dim=24)),
    "nemo": ("mistral", dict(head_dim=32)),
    "mistral_window": ("mistral", dict(sliding_window=WINDOW)),
    "qwen2_window": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3_window": ("qwen3", dict(head_dim=24, attention_bias=True, use_sliding_window=True, sliding_window=WINDOW,
                                   max_window_layers=1)),
    "llama3_rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    # q/k/v, o_proj and gate/up/down biases, drawn at random (transformers starts them at zero)
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True, head_dim=32, random_biases=True)),
}
NO_WINDOW = {  # the same checkpoints loaded without their window, for the references that must differ
    "mistral_window": dict(sliding_window=None),
    "qwen2_window": dict(use_sliding_window=False, layer_types=["full_attention"] * 2),
}
SYSTEM = [random.Random(7).randrange(2, 300) for _ in range(24)]  # six 4-token blocks, three windows


def longer_than_the_window(seed: int, count: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(2, 300) for _ in range(rng.randrange(WINDOW + 2, 40))], rng.randrange(WINDOW, 24))
            for _ in range(count)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    for name, (family, overrides) in FAMILIES.items():
        llm_builders.build_model(repo / name / "1", family, **overrides)
        (repo / name / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    window = repo / "mistral_window" / "1"
    shutil.copytree(window, repo / "chunks" / "1")  # a long prompt in chunks of at most 12 tokens
    (repo / "chunks" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=12))
    # A KV pool too small for everyone at once, though each sequence gives back the blocks behind its window
    shutil.copytree(window, repo / "tight" / "1")
    (repo / "tight" / "config.yaml").write_text(llm_builders.llm_config(num_kv_blocks=12, max_num_batched_tokens=16))
    server = RunningServer(repo)
    yield server, repo
    server.stop()


def generate(server, model, prompt, max_tokens) -> list[int]:
    request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                                  sampling=gen.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return [t for r in gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120) for t in r.token_ids]


def run_concurrently(server, model, cases) -> list[list[int]]:
    with ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(lambda c: generate(server, model, *c), cases))


def reference(repo, model, prompt, n, **overrides) -> list[int]:
    return llm_builders.reference_greedy(repo / model / "1", prompt, n, attn_implementation="eager", **overrides)


@pytest.mark.parametrize("model", list(FAMILIES))
def test_concurrent_streams_match_transformers_greedy(env, model):
    server, repo = env
    cases = longer_than_the_window(1, 12)
    for (prompt, n), got in zip(cases, run_concurrently(server, model, cases)):
        assert got == reference(repo, model, prompt, n)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model=model)
    # the decodes above ran on the CPU kernel wherever it builds (cpu_decode.py), else on gather + SDPA
    config = pb_grpc.GRPCInferenceServiceStub(server.channel).ModelConfig(pb.ModelConfigRequest(name=model)).config
    built = cpu_decode.load(torch.device("cpu"), torch.float32, 1, 1) is not None
    assert config.parameters["attention"].string_value.startswith("decodes in place" if built else "gather + SDPA")


@pytest.mark.parametrize("model", list(NO_WINDOW))
def test_the_window_changes_the_output_and_ferry_follows_it(env, model):
    server, repo = env
    cases = longer_than_the_window(2, 4)
    differs = 0
    for (prompt, n), got in zip(cases, run_concurrently(server, model, cases)):
        windowed = reference(repo, model, prompt, n)
        assert got == windowed
        differs += windowed != reference(repo, model, prompt, n, **NO_WINDOW[model])
    assert differs >= 3


def test_a_prompt_many_windows_long_prefills_in_chunks_and_decodes_past_the_window(env):
    server, repo = env
    rng = random.Random(3)
    prompt, n = [rng.randrange(2, 300) for _ in range(7 * WINDOW + 3)], 4 * WINDOW
    got = generate(server, "chunks", prompt, n)  # before sliding windows, Mistral refused prompts beyond 8
    assert got == reference(repo, "chunks", prompt, n)
    assert got != reference(repo, "chunks", prompt, n, **NO_WINDOW["mistral_window"])


def test_shared_prefix_blocks_under_a_sliding_window(env):
    server, repo = env
    model = "mistral_window"
    warm = (SYSTEM + [5], 3)
    assert generate(server, model, *warm) == reference(repo, model, *warm)
    before = server.metric("ferry_prefix_cache_hit_tokens_total", model=model) or 0.0
    rng = random.Random(4)
    cases = [(SYSTEM + [rng.randrange(2, 300) for _ in range(rng.randrange(1, 10))], rng.randrange(4, 16))
             for _ in range(6)]
    for (prompt, n), got in zip(cases, run_concurrently(server, model, cases)):
        assert got == reference(repo, model, prompt, n)
    assert server.metric("ferry_prefix_cache_hit_tokens_total", model=model) - before >= 6 * len(SYSTEM)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model=model)


def test_preemption_under_a_sliding_window_loses_nothing(env):
    server, repo = env
    cases = longer_than_the_window(5, 12)
    results = until_preempted(server, "tight", lambda: run_concurrently(server, "tight", cases))
    for (prompt, n), got in zip(cases, results):
        assert got == reference(repo, "tight", prompt, n)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="tight")


def test_a_sequence_longer_than_the_kv_pool_runs_when_every_layer_slides(env):
    """12 blocks of 4 tokens hold 48; this sequence grows to 150. Every layer of the Mistral slides, so
    the blocks behind its window are given back as it goes (before that, it was refused at submit)."""
    server, repo = env
    rng = random.Random(8)
    prompt, n = [rng.randrange(2, 300) for _ in range(30)], 120
    got = generate(server, "tight", prompt, n)
    assert got == reference(repo, "tight", prompt, n)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="tight")


def test_llama3_rope_scaling_changes_the_output_and_ferry_follows_it(env):
    server, repo = env
    cases = longer_than_the_window(6, 4)
    unscaled = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    differs = 0
    for (prompt, n), got in zip(cases, run_concurrently(server, "llama3_rope", cases)):
        scaled = reference(repo, "llama3_rope", prompt, n)
        assert got == scaled
        differs += scaled != reference(repo, "llama3_rope", prompt, n, **unscaled)
    assert differs >= 3
