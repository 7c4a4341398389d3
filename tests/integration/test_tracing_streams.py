"""Tracing of the paths test_tracing.py does not cover: ModelStreamInfer and the OpenAI API.

One server traces every request into a file. On one ModelStreamInfer stream the test sends ordinary
infers, a decoupled model's requests (with and without the empty final response) and generation
requests (streamed and whole); over HTTP, OpenAI chat (streamed) and completions (n=2). Once the
server has stopped cleanly, the file is parsed as test_tracing.py parses it: Triton's layout, each
request a trace of its own with Triton's names in order, one INFER_RESPONSE_COMPLETE per decoupled
response, one GRPC_SEND_START/END per response written, FIRST_TOKEN and per-token timestamps. A stream its client cancels while a traced
request is held (a gated model, opened by the test) still ends that request's trace.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import builders, kserve
from tests.conftest import RunningServer, link_shipped_models, wait_for
from tests.integration.test_tracing import GRPC_ORDER, HTTP_ORDER, assert_ordered, named, read_traces

openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")

ROOT = Path(__file__).resolve().parents[2]
GEN_TOKENS = 5
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
X = np.arange(16, dtype=np.float32).reshape(1, 16)


def repeat(request_id: str, values: list[int], empty_final: bool) -> pb.ModelInferRequest:
    inputs = {"IN": np.array(values, np.int32), "DELAY": np.zeros(len(values), np.uint32),
              "WAIT": np.zeros(1, np.uint32)}
    params = {"triton_enable_empty_final_response": True} if empty_final else {}
    return kserve.request("repeat_int32", inputs, request_id=request_id, **params)


def generation(request_id: str, streaming: bool) -> pb.ModelInferRequest:
    params = json.dumps({"max_tokens": GEN_TOKENS, "ignore_eos": True}).encode()
    return kserve.request("tiny_llama", {"text_input": np.array([b"A ferry leaves"], dtype=object),
                                         "stream": np.array([streaming]),
                                         "sampling_parameters": np.array([params], dtype=object)},
                          request_id=request_id)


def stamps(trace: dict, name: str) -> list[int]:
    return [ns for n, ns in trace["stamps"] if n == name]


def written(path: Path) -> dict:
    """The traces in the file now (it is a complete JSON array after every write; {} before the first)."""
    try:
        return read_traces(path)
    except (FileNotFoundError, ValueError):
        return {}


def cancel_a_stream_while_its_request_is_held(server, gate: Path, path: Path) -> dict:
    """A traced request held in the gated model; its client cancels the stream: the trace must still end."""
    keep_open = threading.Event()

    def requests():
        yield kserve.request("gated", {"X": np.full((1, 2), -1.0, np.float32)}, request_id="s-held")
        keep_open.wait(60)

    call = kserve.stub(server.channel).ModelStreamInfer(requests(), timeout=120)
    try:
        wait_for(gate.with_name(gate.name + ".running").exists, what="the request to hold the gated model")
        call.cancel()
        wait_for(lambda: named(written(path), "s-held"), what="the cancelled request's trace to be written")
    finally:
        keep_open.set()
        gate.touch()
    return written(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    repo = tmp_path_factory.mktemp("repo")
    link_shipped_models(repo, "simple", "repeat_int32")
    gate = repo / "gate"
    builders.gated_model(repo, "gated", gate=gate)
    shutil.copytree(ROOT / "model_repository" / "tiny_llama", repo / "tiny_llama")
    (repo / "tiny_llama" / "1" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    path = tmp_path_factory.mktemp("traces") / "trace.json"
    server = RunningServer(repo, "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                           "--trace-config", "rate=1")
    seen = {}
    try:
        requests = [kserve.request("simple", {"INPUT0": X, "INPUT1": X}, request_id="s-infer-0"),
                    repeat("s-repeat", [4, 5, 6], empty_final=True), repeat("s-repeat-plain", [7, 8], empty_final=False),
                    generation("s-gen", streaming=True), generation("s-gen-whole", streaming=False),
                    kserve.request("simple", {"INPUT0": X, "INPUT1": X}, request_id="s-infer-1")]
        responses = list(kserve.stub(server.channel).ModelStreamInfer(iter(requests), timeout=120))
        assert not any(r.error_message for r in responses), [r.error_message for r in responses if r.error_message]
        seen["stream"] = {}
        for r in responses:
            seen["stream"].setdefault(r.infer_response.id, []).append(r)
        client = openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        chunks = list(client.chat.completions.create(
            model="tiny_llama", messages=[{"role": "user", "content": "Where does the ferry go?"}],
            max_tokens=GEN_TOKENS, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        seen["chat"] = chunks
        seen["completion"] = client.completions.create(model="tiny_llama", prompt="A ferry leaves", max_tokens=GEN_TOKENS,
                                                       n=2, seed=3, extra_body={"ignore_eos": True})
        seen["held"] = named(cancel_a_stream_while_its_request_is_held(server, gate, path), "s-held")
    finally:
        assert server.stop() == 0
    seen["traces"] = read_traces(path)
    return seen


def test_each_infer_on_a_stream_is_its_own_trace_with_tritons_names_in_order(run):
    for request_id in ("s-infer-0", "s-infer-1"):
        [trace] = named(run["traces"], request_id)
        assert trace["header"]["model_name"] == "simple" and trace["header"]["model_version"] == 1
        assert_ordered(trace, GRPC_ORDER)
        assert [n for n, _ in trace["stamps"]].count("GRPC_SEND_END") == 1
        assert not any(n.startswith("HTTP_") for n, _ in trace["stamps"])


def test_a_decoupled_request_has_a_response_timestamp_and_a_send_per_response(run):
    [trace] = named(run["traces"], "s-repeat")
    assert len(run["stream"]["s-repeat"]) == 4  # three answers, then the empty final one
    completes, starts, ends = (stamps(trace, n) for n in ("INFER_RESPONSE_COMPLETE", "GRPC_SEND_START", "GRPC_SEND_END"))
    assert len(completes) == 3 and len(starts) == len(ends) == 4
    for complete, start, end in zip(completes, starts, ends):
        assert complete <= start <= end
    assert_ordered(trace, ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
                           "COMPUTE_END", "REQUEST_END"])
    assert stamps(trace, "COMPUTE_START")[0] <= completes[0] and completes[-1] <= stamps(trace, "COMPUTE_END")[0]
    assert ends[-1] == max(ns for _, ns in trace["stamps"])  # the trace ends with its last response written
    [plain] = named(run["traces"], "s-repeat-plain")
    assert len(stamps(plain, "INFER_RESPONSE_COMPLETE")) == len(stamps(plain, "GRPC_SEND_END")) == 2
    assert len(run["stream"]["s-repeat-plain"]) == 2


def test_a_generation_on_a_stream_has_first_token_and_per_token_timestamps(run):
    [trace] = named(run["traces"], "s-gen")
    sent = run["stream"]["s-gen"]
    names = [n for n, _ in trace["stamps"]]
    assert names.count("INFER_RESPONSE_COMPLETE") == len(sent) == names.count("GRPC_SEND_END") >= 1
    assert names.count("FIRST_TOKEN") == 1
    assert stamps(trace, "FIRST_TOKEN") == stamps(trace, "INFER_RESPONSE_COMPLETE")[:1]
    assert_ordered(trace, ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START", "FIRST_TOKEN",
                           "REQUEST_END", "GRPC_SEND_START", "GRPC_SEND_END"])
    [whole] = named(run["traces"], "s-gen-whole")
    names = [n for n, _ in whole["stamps"]]
    assert len(run["stream"]["s-gen-whole"]) == 1 == names.count("GRPC_SEND_END")
    assert names.count("INFER_RESPONSE_COMPLETE") == GEN_TOKENS and names.count("FIRST_TOKEN") == 1  # one per token


def test_openai_chat_stream_is_traced_with_http_names(run):
    chunks = run["chat"]
    [trace] = named(run["traces"], chunks[0].id)
    assert trace["header"]["model_name"] == "tiny_llama" and trace["header"]["model_version"] == 1
    names = [n for n, _ in trace["stamps"]]
    assert names.count("INFER_RESPONSE_COMPLETE") == GEN_TOKENS and names.count("FIRST_TOKEN") == 1  # one per token
    assert chunks[-1].usage.completion_tokens == GEN_TOKENS
    assert_ordered(trace, ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "FIRST_TOKEN",
                           "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"])
    assert not any(n.startswith("GRPC_") for n in names)


def test_openai_completions_with_two_choices_is_one_trace_ending_after_both(run):
    completion = run["completion"]
    [trace] = named(run["traces"], completion.id)
    names = [n for n, _ in trace["stamps"]]
    assert len(completion.choices) == 2 and completion.usage.completion_tokens == 2 * GEN_TOKENS
    assert names.count("INFER_RESPONSE_COMPLETE") >= 2 and names.count("REQUEST_END") == 1
    assert stamps(trace, "REQUEST_END")[0] >= max(stamps(trace, "INFER_RESPONSE_COMPLETE"))
    assert_ordered(trace, [n for n in HTTP_ORDER if not n.startswith("COMPUTE_") and n != "INFER_RESPONSE_COMPLETE"])


def test_a_stream_cancelled_while_its_request_runs_still_ends_that_trace(run):
    [held] = run["held"]
    assert held["header"]["model_name"] == "gated"
    assert_ordered(held, ["GRPC_WAITREAD_START", "GRPC_WAITREAD_END", "REQUEST_START", "QUEUE_START"])
    assert not any(n.startswith("GRPC_SEND") for n, _ in held["stamps"])  # never answered
    assert named(run["traces"], "s-held") == run["held"]  # written once
