"""Penalties, min_tokens and logprobs on every entrance, checked against transformers (its own logits
processors where it has them, a by-hand torch reference over its logits where it does not)."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

pytest.importorskip("transformers", reason="transformers builds the reference models (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")

import torch  # noqa: E402
import transformers  # noqa: E402

from protos import generate_pb2 as gen  # noqa: E402
from protos import generate_pb2_grpc as gen_grpc  # noqa: E402
from tests import kserve, llm_builders  # noqa: E402
from tests.conftest import RunningServer, approx_fp32  # noqa: E402

PROMPT = [5, 17, 42, 99, 7, 5, 17]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llama = llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_batched_tokens=48))
    first = llm_builders.reference_greedy(llama, PROMPT, 1)[0]
    shutil.copytree(llama, repo / "eos" / "1")  # its end-of-sequence token is what the model says first
    (repo / "eos" / "1" / "generation_config.json").write_text(json.dumps({"eos_token_id": first}))
    (repo / "eos" / "config.yaml").write_text(llm_builders.llm_config())
    (llama / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"}))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    server = RunningServer(repo)
    server.repo = repo
    yield server, model, first
    server.stop()


def stream(server, model="llama", prompt=PROMPT, **sampling) -> list[gen.GenerateResponse]:
    request = gen.GenerateRequest(model_name=model, sampling=gen.SamplingParams(**sampling))
    request.token_ids.ids.extend(prompt)
    return list(gen_grpc.GenerationStub(server.channel).Generate(request, timeout=120))


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def by_hand(model, prompt: list[int], n: int, presence=0.0, frequency=0.0) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding over transformers' logits with OpenAI's presence/frequency penalties on output tokens;
    returns the tokens and the log_softmax each was chosen from."""
    ids, chosen, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(chosen, dtype=torch.long), minlength=logits.shape[-1]).float()
            logits = logits - frequency * counts - presence * (counts > 0)
            token = int(logits.argmax())
            chosen.append(token)
            ids.append(token)
            logprobs.append(logits.log_softmax(-1))
    return chosen, logprobs


def test_repetition_penalty_equals_transformers_generate(env):
    server, model, _ = env
    plain = tokens(stream(server, max_tokens=20, ignore_eos=True))
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                             repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(PROMPT):].tolist()
    assert expected != plain  # the penalty changes this model's greedy output
    with ThreadPoolExecutor(3) as pool:  # batched beside unpenalized rows, which must stay as they were
        results = list(pool.map(lambda p: tokens(stream(server, max_tokens=20, ignore_eos=True, **p)),
                                [dict(repetition_penalty=1.8), {}, dict(repetition_penalty=1.8)]))
    assert results == [expected, plain, expected]


@pytest.mark.parametrize("penalties", [dict(presence_penalty=1.5), dict(frequency_penalty=2.0),
                                       dict(presence_penalty=2.0, frequency_penalty=-0.5)])
def test_presence_and_frequency_penalties_equal_a_torch_reference(env, penalties):
    server, model, _ = env
    expected, _ = by_hand(model, PROMPT, 16, penalties.get("presence_penalty", 0.0),
                          penalties.get("frequency_penalty", 0.0))
    assert expected != by_hand(model, PROMPT, 16)[0]  # the penalty matters here
    assert tokens(stream(server, max_tokens=16, ignore_eos=True, **penalties)) == expected


def test_min_tokens_delays_eos_as_transformers_does(env):
    server, model, eos = env
    assert stream(server, "eos", max_tokens=10)[-1].finish_reason == "eos"  # without min_tokens it ends at once
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=10, min_new_tokens=4, do_sample=False,
                             eos_token_id=eos, pad_token_id=0)
    expected = out[0, len(PROMPT):].tolist()
    responses = stream(server, "eos", max_tokens=10, min_tokens=4)
    assert tokens(responses) == expected and eos not in expected[:4]
    assert responses[-1].finish_reason == ("eos" if expected[-1] == eos else "length")
    stopped = stream(server, "llama", max_tokens=10, min_tokens=3, ignore_eos=True, stop_token_ids=[expected[0]])
    assert expected[0] not in tokens(stopped)[:3]  # a stop token id waits for min_tokens too


def test_logprobs_equal_log_softmax_of_transformers_logits(env):
    server, model, _ = env
    expected, reference = by_hand(model, PROMPT, 8)
    responses = stream(server, max_tokens=8, ignore_eos=True, logprobs=5)
    entries = [e for r in responses for e in r.logprobs]
    assert tokens(responses) == expected and len(entries) == 8
    # another implementation (transformers' eager model over the whole sequence, Ferry's paged KV a step at a
    # time): up to 2e-5 apart here, so 1e-3, not approx_fp32; a wrong position or token is off by 1e-2 or more
    for token, entry, ref in zip(expected, entries, reference):
        assert entry.sampled.token_id == token
        assert entry.sampled.logprob == pytest.approx(float(ref[token]), abs=1e-3)
        top = torch.topk(ref, 5)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top.values.tolist(), abs=1e-3)
        assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
    none = stream(server, max_tokens=3, ignore_eos=True)
    assert all(not r.logprobs for r in none)
    only = stream(server, max_tokens=3, ignore_eos=True, logprobs=0)
    assert all(len(r.logprobs) == 1 and not r.logprobs[0].top for r in only)


def test_stream_infer_takes_the_new_parameters_and_returns_logprobs(env):
    server, model, _ = env
    text = "the ferry leaves"
    params = {"max_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.8, "logprobs": 2}
    request = kserve.request("llama", {"text_input": np.array([text.encode()], dtype=object),
                                       "stream": np.array([True]),
                                       "sampling_parameters": np.array([json.dumps(params).encode()], dtype=object)},
                             request_id="lp")
    responses = list(kserve.stub(server.channel).ModelStreamInfer(iter([request]), timeout=120))
    assert not any(r.error_message for r in responses)
    got = []
    for r in responses:
        names = [o.name for o in r.infer_response.outputs]
        raw = r.infer_response.raw_output_contents[names.index("logprobs")]
        got += json.loads(raw[4:].decode())  # a BYTES element: 4-byte length, then the JSON
    grpc_entries = [e for r in stream(server, prompt=_ids(server, text), max_tokens=6, ignore_eos=True,
                                      repetition_penalty=1.8, logprobs=2) for e in r.logprobs]
    assert len(got) == len(grpc_entries) == 6
    for position, entry in zip(got, grpc_entries):
        sampled = position[str(entry.sampled.token_id)]
        assert sampled["logprob"] == approx_fp32(entry.sampled.logprob)  # two runs of the model
        assert {int(k) for k, v in position.items() if v["rank"] <= 2} == {t.token_id for t in entry.top}


def _ids(server, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(server.repo / "llama" / "1" / "tokenizer.json")).encode(text).ids


BAD = [dict(repetition_penalty=0.0), dict(repetition_penalty=-1.0), dict(repetition_penalty=float("nan")),
       dict(presence_penalty=2.5), dict(presence_penalty=float("inf")), dict(frequency_penalty=-2.1),
       dict(frequency_penalty=float("nan")), dict(logprobs=21), dict(min_tokens=30)]
BAD_JSON = ['{"repetition_penalty": 0}', '{"repetition_penalty": NaN}', '{"presence_penalty": 3}',
            '{"frequency_penalty": "x"}', '{"logprobs": -1}', '{"logprobs": 21}', '{"logprobs": 1.5}',
            '{"min_tokens": 30, "max_tokens": 10}', '{"min_tokens": -1}', '{"logprobs": true}']


def test_bad_values_are_refused_on_every_entrance_while_good_streams_finish(env):
    server, _, _ = env
    with ThreadPoolExecutor(4 + len(BAD)) as pool:
        good = [pool.submit(stream, server, max_tokens=24, ignore_eos=True, presence_penalty=0.5, logprobs=1)
                for _ in range(4)]
        bad = [pool.submit(stream, server, max_tokens=24, ignore_eos=True, **params) for params in BAD]
        for params, future in zip(BAD, bad):
            with pytest.raises(grpc.RpcError) as info:
                future.result()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, params
        for future in good:
            assert future.result()[-1].finish_reason == "length"
    requests = [kserve.request("llama", {"text_input": np.array([b"the ferry"], dtype=object),
                                         "sampling_parameters": np.array([text.encode()], dtype=object)},
                               request_id=f"bad-{i}") for i, text in enumerate(BAD_JSON)]
    requests.append(kserve.request("llama", {"text_input": np.array([b"the ferry"], dtype=object),
                                             "sampling_parameters": np.array([b'{"max_tokens": 5, "ignore_eos": true}'],
                                                                             dtype=object)}, request_id="good"))
    responses = list(kserve.stub(server.channel).ModelStreamInfer(iter(requests), timeout=120))
    errors = {r.infer_response.id for r in responses if r.error_message}
    assert errors == {f"bad-{i}" for i in range(len(BAD_JSON))}
    assert [r.infer_response.parameters["finish_reason"].string_param for r in responses
            if r.infer_response.id == "good"] == ["length"]
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for extra in (dict(presence_penalty=3), dict(frequency_penalty=-3), dict(logprobs=21)):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="llama", prompt="hi", max_tokens=2, **extra)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="llama", prompt="hi", max_tokens=2, extra_body={"repetition_penalty": 0})


def test_openai_package_returns_logprobs(env):
    server, model, _ = env
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    expected, reference = by_hand(model, PROMPT, 5)
    whole = client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                      extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == 5 and "".join(lp.tokens) == whole.choices[0].text
    # transformers against Ferry: 1e-3, as in test_logprobs_equal_log_softmax_of_transformers_logits
    assert lp.token_logprobs == pytest.approx([float(r[t]) for t, r in zip(expected, reference)], abs=1e-3)
    assert all(len(top) <= 3 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    chunks = list(client.completions.create(model="llama", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == approx_fp32(lp.token_logprobs)  # another run, batched its own way
    no = client.completions.create(model="llama", prompt=PROMPT, max_tokens=2, temperature=0)
    assert no.choices[0].logprobs is None


def test_openai_chat_logprobs(env):
    server, _, _ = env
    client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "the ferry"}]
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = whole.choices[0].logprobs.content
    assert len(content) == 6 and "".join(c.token for c in content) == whole.choices[0].message.content
    for c in content:  # greedy: the sampled token is the most likely one
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        # one tensor read twice (gather and topk of one step's log_softmax): the same value, default approx
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.token == c.top_logprobs[0].token
        assert bytes(c.bytes).decode(errors="replace") == c.token
    chunks = list(client.chat.completions.create(model="llama", messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert streamed == approx_fp32([c.logprob for c in content])  # another run, batched its own way
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="llama", messages=messages, max_tokens=2, top_logprobs=2)
