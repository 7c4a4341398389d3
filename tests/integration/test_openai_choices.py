"""OpenAI's `n` and `best_of` with the `openai` package, unchanged: the choices share one prefill of the
prompt (prefix cache), seeded choices reproduce, best_of keeps the highest cumulative logprob, usage is
counted as OpenAI counts it, streamed chunks name their choice, and what stays unsupported is a 400."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")

from tests import llm_builders  # noqa: E402
from tests.conftest import RunningServer  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
BLOCK = 4
PROMPT = list(range(5, 47))  # 42 tokens: 10 full KV blocks and a partial one


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llama = llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(block_size=BLOCK))
    (llama / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    server = RunningServer(repo)
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", timeout=120)  # default retries
    yield server, client
    server.stop()


def counter(server, name: str) -> float:
    return server.metric(name, model="llama") or 0.0


def test_greedy_n_gives_identical_choices_from_one_prefill(env):
    server, client = env
    query, hits = counter(server, "ferry_prefix_cache_query_tokens"), counter(server, "ferry_prefix_cache_hit_tokens")
    answer = client.completions.create(model="llama", prompt=PROMPT, n=3, temperature=0, max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.text for c in answer.choices}) == 1 and answer.choices[0].text
    assert answer.usage.prompt_tokens == 42 and answer.usage.completion_tokens == 3 * 8
    assert answer.usage.total_tokens == 42 + 24
    # one prefill: the two later choices found the first one's 10 full blocks cached
    assert counter(server, "ferry_prefix_cache_query_tokens") - query == 3 * 42
    assert counter(server, "ferry_prefix_cache_hit_tokens") - hits == 2 * 10 * BLOCK
    single = client.completions.create(model="llama", prompt=PROMPT, temperature=0, max_tokens=8,
                                       extra_body={"ignore_eos": True})
    assert single.choices[0].text == answer.choices[0].text


def test_choices_sharing_a_long_prompt_read_it_once_and_score_as_one_alone(env):
    """Eight choices of a 264-token prompt hold its 66 cached blocks together: attention reads them once
    for all eight (shared_prefix.py), and every choice's tokens and logprobs equal a lone request's."""
    server, client = env
    prompt = [2 + (i * 37) % 290 for i in range(264)]
    kwargs = dict(model="llama", prompt=prompt, temperature=0, max_tokens=10, logprobs=0, extra_body={"ignore_eos": True})
    single = client.completions.create(**kwargs).choices[0]
    saved = counter(server, "ferry_attention_shared_prefix_saved_key_reads")
    answer = client.completions.create(n=8, **kwargs)
    assert counter(server, "ferry_attention_shared_prefix_saved_key_reads") - saved >= 6 * 264  # >= 7 members a step
    for choice in answer.choices:
        assert choice.text == single.text and choice.logprobs.tokens == single.logprobs.tokens
        assert choice.logprobs.token_logprobs == pytest.approx(single.logprobs.token_logprobs, abs=1e-4)


def test_greedy_chat_n(env):
    _, client = env
    answer = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "the ferry"}], n=3,
                                            temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.message.content for c in answer.choices}) == 1
    assert answer.usage.completion_tokens == 18


def test_seeded_sampled_choices_reproduce_and_differ(env):
    _, client = env

    def texts():
        answer = client.completions.create(model="llama", prompt=PROMPT, n=3, temperature=3.0, seed=7, max_tokens=16,
                                           extra_body={"ignore_eos": True})
        return [c.text for c in answer.choices]

    first = texts()
    assert texts() == first
    assert len(set(first)) == 3  # choice i samples with seed + i


def test_best_of_keeps_the_highest_cumulative_logprob(env):
    _, client = env
    kwargs = dict(model="llama", prompt=PROMPT, temperature=3.0, seed=11, max_tokens=12, logprobs=0,
                  extra_body={"ignore_eos": True})
    every = client.completions.create(n=3, **kwargs)
    scores = {c.text: sum(c.logprobs.token_logprobs) for c in every.choices}
    best = client.completions.create(n=1, best_of=3, **kwargs)
    assert len(best.choices) == 1 and best.choices[0].index == 0
    assert best.choices[0].text == max(scores, key=scores.get)
    assert best.usage.completion_tokens == 3 * 12  # every generated choice is counted, as OpenAI does
    two = client.completions.create(n=2, best_of=3, **kwargs)
    assert [c.text for c in two.choices] == sorted(scores, key=scores.get, reverse=True)[:2]


def test_streamed_choices_carry_their_index(env):
    _, client = env
    whole = client.completions.create(model="llama", prompt=PROMPT, n=2, temperature=0, max_tokens=6,
                                      extra_body={"ignore_eos": True})
    texts, finishes, usages = {0: "", 1: ""}, {}, []
    for chunk in client.completions.create(model="llama", prompt=PROMPT, n=2, temperature=0, max_tokens=6, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert texts == {0: whole.choices[0].text, 1: whole.choices[1].text}
    assert finishes == {0: "length", 1: "length"}
    assert len(usages) == 1 and usages[0].completion_tokens == 12 and usages[0].prompt_tokens == 42


@pytest.mark.parametrize("kwargs, words", [
    (dict(n=0), "'n' must be an integer within [1, 128]"),
    (dict(n=2, best_of=1), "'best_of' (1) must be greater than or equal to 'n' (2)"),
    (dict(best_of=2, stream=True), "'best_of' cannot be used with 'stream'"),
])
def test_what_stays_unsupported_is_a_400(env, kwargs, words):
    _, client = env
    with pytest.raises(openai.BadRequestError) as info:
        result = client.completions.create(model="llama", prompt="hi", max_tokens=2, **kwargs)
        list(result) if kwargs.get("stream") else None
    assert words in info.value.message


def test_chat_has_no_best_of(env):
    _, client = env
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"best_of": 2})
    assert "'best_of' is a /v1/completions parameter" in info.value.message
