"""Speculative decoding (prompt lookup) through the real server: drafts are accepted, and every output is
exactly what decoding one token a step gives (transformers' greedy decoding; Ferry without drafts for
sampled, penalized and logprob requests), with max_tokens and stop ids exact and every KV block back."""

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
from tests.conftest import RunningServer, approx_fp32, wait_for

rng = random.Random(11)
BASE = [rng.randrange(2, 300) for _ in range(12)]
REPEATING = BASE * 3  # a prompt that repeats itself
RANDOM = [rng.randrange(2, 300) for _ in range(36)]
SPEC = {"speculative": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    # loop: next token depends on the current one only, so greedy output soon cycles (long accepted runs);
    # mixed: a little attention, so the cycles break where the context says (accepted and rejected drafts)
    for name, scale in (("loop", 0.0), ("mixed", 0.01), ("plain", 1.0)):
        llm_builders.build_model(repo / name / "1", "llama", attention_scale=scale)
        (repo / name / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48, **SPEC))
    for name in ("loop", "mixed"):
        shutil.copytree(repo / name / "1", repo / f"{name}_off" / "1")
        (repo / f"{name}_off" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    server = RunningServer(repo, "--model-control-mode", "explicit", "--load-model", "*")  # loads a model: explicit control
    yield server, repo
    server.stop()


def stream(server, model, prompt, **sampling) -> list[gen.GenerateResponse]:
    request = gen.GenerateRequest(model_name=model, token_ids=gen.TokenIds(ids=prompt),
                                  sampling=gen.SamplingParams(**{"ignore_eos": True, **sampling}))
    return list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def accepted(server, model) -> float:
    return server.metric("ferry_spec_decode_num_accepted_tokens_total", model=model) or 0.0


def wait_for_more(server, model, before: float) -> float:
    """The counters are published at the start of the next step loop: wait for it (generously)."""
    wait_for(lambda: accepted(server, model) > before, 30, f"{model}'s accepted-token counter to move")
    return accepted(server, model)


@pytest.mark.parametrize("model", ["loop", "mixed"])
def test_greedy_output_equals_transformers_and_drafts_are_accepted(env, model):
    server, repo = env
    cases = [(REPEATING, 40), (RANDOM, 40), (BASE, 25), (RANDOM[:5] * 2, 33)]
    before = accepted(server, model)
    with ThreadPoolExecutor(len(cases)) as pool:  # batched together, each drafting its own way
        results = list(pool.map(lambda c: tokens(stream(server, model, c[0], max_tokens=c[1])), cases))
    for (prompt, n), got in zip(cases, results):
        assert got == llm_builders.reference_greedy(repo / model / "1", prompt, n)
    assert wait_for_more(server, model, before) > before
    drafted = server.metric("ferry_spec_decode_num_draft_tokens_total", model=model)
    assert drafted >= accepted(server, model)
    assert 0 < server.metric("ferry_spec_decode_acceptance_rate", model=model) <= 1
    server.wait_for_metric("ferry_kv_blocks_used", 0, model=model)


def test_a_prompt_that_does_not_repeat_decodes_exactly(env):
    server, repo = env
    for prompt in (RANDOM, REPEATING):
        got = tokens(stream(server, "plain", prompt, max_tokens=30))
        assert got == llm_builders.reference_greedy(repo / "plain" / "1", prompt, 30)
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="plain")


def test_cached_prefix_then_drafts_still_exact(env):
    server, repo = env
    expected = llm_builders.reference_greedy(repo / "mixed" / "1", REPEATING + [5], 30)
    hits = server.metric("ferry_prefix_cache_hit_tokens_total", model="mixed") or 0
    for _ in range(2):  # the second finds the first's prompt (and kept output) blocks cached
        assert tokens(stream(server, "mixed", REPEATING + [5], max_tokens=30)) == expected
    assert server.metric("ferry_prefix_cache_hit_tokens_total", model="mixed") > hits


def test_max_tokens_and_stop_ids_are_exact(env):
    server, repo = env
    reference = llm_builders.reference_greedy(repo / "loop" / "1", RANDOM, 40)
    for n in (1, 2, 5, 13, 40):
        responses = stream(server, "loop", RANDOM, max_tokens=n)
        assert tokens(responses) == reference[:n] and responses[-1].finish_reason == "length"
    stop = reference[20]  # in the loop: drafted again and again once min_tokens lets its first occurrence pass
    first = reference.index(stop)
    responses = stream(server, "loop", RANDOM, max_tokens=40, stop_token_ids=[stop])
    assert tokens(responses) == reference[: first + 1] and responses[-1].finish_reason == "stop"
    # min_tokens masks the stop id at first (the output leaves plain greedy there): Ferry without drafts is the reference
    held = dict(max_tokens=40, stop_token_ids=[stop], min_tokens=first + 1)
    responses, plain = stream(server, "loop", RANDOM, **held), stream(server, "loop_off", RANDOM, **held)
    assert tokens(responses) == tokens(plain) and responses[-1].finish_reason == plain[-1].finish_reason == "stop"
    assert responses[-1].usage.completion_tokens == len(tokens(plain)) > first + 4  # the stop came round again
    server.wait_for_metric("ferry_kv_blocks_used", 0, model="loop")


@pytest.mark.parametrize("sampling", [
    {"temperature": 0.7, "seed": 3},
    {"temperature": 1.0, "top_k": 5, "seed": 9},
    {"repetition_penalty": 1.1},  # mild: it changes the output, which still loops enough to keep drafts
    {"frequency_penalty": 0.2, "presence_penalty": 0.1},
    {"logprobs": 3},
], ids=["seeded", "seeded-top-k", "repetition", "frequency-presence", "logprobs"])
def test_sampled_penalized_and_logprob_requests_equal_decoding_without_drafts(env, sampling):
    server, _ = env
    for model in ("loop", "mixed"):
        before = accepted(server, model)
        drafted = server.metric("ferry_spec_decode_num_draft_tokens_total", model=model) or 0
        on = stream(server, model, REPEATING, max_tokens=40, **sampling)
        off = stream(server, f"{model}_off", REPEATING, max_tokens=40, **sampling)
        assert tokens(on) == tokens(off)
        assert [len(r.token_ids) for r in on] == [len(r.logprobs) for r in on] if "logprobs" in sampling else True
        # drafts are verified several positions at once, without drafts one a step: fp32 sums in another order
        for a, b in zip([e for r in on for e in r.logprobs], [e for r in off for e in r.logprobs]):
            assert a.sampled.token_id == b.sampled.token_id and a.sampled.logprob == approx_fp32(b.sampled.logprob)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
        if model == "loop" and "penalty" in str(sampling):
            assert tokens(on) != tokens(stream(server, f"{model}_off", REPEATING, max_tokens=40))  # it did penalize
        assert server.metric("ferry_spec_decode_num_draft_tokens_total", model=model) > drafted
        if model == "loop":
            assert wait_for_more(server, model, before) > before  # drafts were kept for this request too
        server.wait_for_metric("ferry_kv_blocks_used", 0, model=model)


def test_bad_speculative_configs_are_refused_at_load(env):
    server, repo = env
    stub = kserve.stub(server.channel)
    for spec, field in (({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                        ({"method": "ngram"}, "num_speculative_tokens"),
                        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
                         "prompt_lookup_min")):
        shutil.rmtree(repo / "bad", ignore_errors=True)
        shutil.copytree(repo / "plain" / "1", repo / "bad" / "1")
        (repo / "bad" / "config.yaml").write_text(llm_builders.llm_config(speculative=spec))
        with pytest.raises(Exception) as failure:
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="bad"), timeout=60)
        assert f"generation.speculative.{field}" in str(failure.value)
    config = stub.ModelConfig(pb.ModelConfigRequest(name="loop")).config
    assert config.generation.speculative.method == "ngram" and config.generation.speculative.num_speculative_tokens == 4
