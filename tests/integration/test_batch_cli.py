"""`ferry batch`: a file of requests in OpenAI's Batch format answered in-process, through a running
server (--url) or on Ray, each line's answer exactly what Ferry's HTTP API gives for the same body;
invalid files refused whole; bad bodies answered in place; a SIGKILLed run resumed to exactly once."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers builds the tiny llama (test extra)")
openai = pytest.importorskip("openai", reason="the openai package is part of the test extra")

from openai.types import BatchError, Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402
from openai.types.shared import ErrorObject  # noqa: E402

from tests import builders, llm_builders  # noqa: E402
from tests.conftest import ROOT, RunningServer, link_shipped_models, wait_for  # noqa: E402

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}}, "required": ["ok", "n"],
        "additionalProperties": False}
WORDS = "the ferry leaves when it is full or when it is time batching is what this server is about".split()


def request(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def tensor(name: str, rows: list[list[float]]) -> dict:
    return {"name": name, "shape": [len(rows), len(rows[0])], "datatype": "FP32", "data": [v for r in rows for v in r]}


def chat(i: int, **extra) -> dict:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " ".join(WORDS[i % 7:i % 7 + 3 + i % 5])}]
    return {"model": "llama", "messages": messages, "max_tokens": 4 + i % 6, "temperature": 0, "ignore_eos": True, **extra}


def completion(i: int, **extra) -> dict:
    return {"model": "llama", "prompt": " ".join(WORDS[i % 5:i % 5 + 1 + i % 9]), "max_tokens": 3 + i % 7,
            "temperature": 0, "ignore_eos": True, **extra}


LINES = [
    *(request(f"chat-{i}", "/v1/chat/completions", chat(i)) for i in range(8)),
    request("chat-logprobs", "/v1/chat/completions", chat(3, logprobs=True, top_logprobs=2, max_completion_tokens=5)),
    request("chat-json", "/v1/chat/completions", chat(2, response_format={"type": "json_schema", "json_schema": {
        "name": "flag", "schema": FLAG}}, max_tokens=40, ignore_eos=False)),
    request("cmpl-choice", "/v1/completions", completion(3, guided_choice=["north", "south"], max_tokens=10, ignore_eos=False)),
    *(request(f"cmpl-{i}", "/v1/completions", completion(i)) for i in range(8)),
    request("cmpl-ids", "/v1/completions", {"model": "llama", "prompt": [5, 17, 42, 99, 7, 3], "max_tokens": 12,
                                            "temperature": 0, "ignore_eos": True, "logprobs": 2}),
    request("infer-1", "/v2/models/simple/infer",
            {"inputs": [tensor("INPUT0", [[i * 0.5 for i in range(16)]]), tensor("INPUT1", [[1.25] * 16])]}),
    request("infer-2", "/v2/models/simple/versions/1/infer",
            {"inputs": [tensor("INPUT0", [[float(i) for i in range(16)], [-1.5] * 16]),
                        tensor("INPUT1", [[2.0] * 16, [float(i) / 3 for i in range(16)]])],
             "outputs": [{"name": "OUTPUT1"}]}),
    *(request(f"gen-{i}", "/v2/models/llama/generate",
              {"text_input": " ".join(WORDS[i:i + 4]), "max_tokens": 4 + i, "temperature": 0, "ignore_eos": True})
      for i in range(3)),
    request("gen-excluded", "/v2/models/llama/generate",
            {"text_input": "the ferry", "parameters": {"max_tokens": 5, "temperature": 0, "ignore_eos": True},
             "exclude_input_in_output": True}),
    # bodies the HTTP API refuses: each gets its 4xx line and the run goes on
    request("bad-model", "/v1/chat/completions", {**chat(1), "model": "no_such_model"}),
    request("bad-temperature", "/v1/completions", completion(2, temperature=-1)),
    request("bad-shape", "/v2/models/simple/infer", {"inputs": [tensor("INPUT0", [[1.0, 2.0, 3.0]]),
                                                                tensor("INPUT1", [[1.0, 2.0, 3.0]])]}),
    request("bad-generate", "/v2/models/no_such_model/generate", {"text_input": "x"}),
    request("bad-field", "/v1/completions", completion(4, frobnicate=True)),
]
REFUSED = {"bad-model": 404, "bad-temperature": 400, "bad-shape": 400, "bad-generate": 404, "bad-field": 400}


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def ferry_batch(*args, timeout_s: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "batch", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_id(path: Path) -> dict[str, dict]:
    found = records(path)
    ids = [r["custom_id"] for r in found]
    assert len(ids) == len(set(ids)), "a custom_id answered twice"
    return {r["custom_id"]: r for r in found}


def same(body) -> object:
    """What must match between two answers to one body: all but ids and creation times; floats to a
    tolerance that holds across batch shapes."""
    if isinstance(body, dict):
        return {k: same(v) for k, v in body.items() if k not in ("id", "created", "request_id")}
    if isinstance(body, list):
        return [same(v) for v in body]
    if isinstance(body, float):
        return pytest.approx(body, rel=1e-4, abs=1e-4)  # logprobs and tensors computed in other batch shapes
    return body


def http_answer(server: RunningServer, url: str, body: dict) -> tuple[int, dict]:
    call = urllib.request.Request(server.http_url + url, data=json.dumps(body).encode(),
                                  headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(call, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    llama = llm_builders.build_model(repo / "llama" / "1", "llama")
    (repo / "llama" / "config.yaml").write_text(llm_builders.llm_config(max_num_seqs=8))
    (llama / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))
    link_shipped_models(repo, "simple")
    gate = tmp_path_factory.mktemp("gate") / "open"
    builders.gated_model(repo, "gated", gate=gate, max_batch_size=1)
    files = tmp_path_factory.mktemp("files")
    source = write_jsonl(files / "input.jsonl", LINES)
    here = files / "in_process.jsonl"
    done = ferry_batch("-i", source, "-o", here, "--model-repository", repo, "--max-in-flight", 16)
    assert done.returncode == 0, done.stderr
    server = RunningServer(repo)
    yield repo, server, source, here, gate
    server.stop()


def test_every_path_equals_what_the_http_api_answers(env):
    _, server, _, here, _ = env
    answers = by_id(here)
    assert set(answers) == {line["custom_id"] for line in LINES}
    for line in LINES:
        status, body = http_answer(server, line["url"], line["body"])
        got = answers[line["custom_id"]]["response"]
        assert (got["status_code"], same(got["body"])) == (status, same(body)), line["custom_id"]
    assert answers["chat-0"]["response"]["body"]["usage"]["completion_tokens"] == 4  # ignore_eos: all of max_tokens
    assert answers["cmpl-ids"]["response"]["body"]["usage"] == {"prompt_tokens": 6, "completion_tokens": 12,
                                                                "total_tokens": 18}
    outputs = answers["infer-1"]["response"]["body"]["outputs"]
    assert {o["name"]: o["data"] for o in outputs} == {"OUTPUT0": pytest.approx([i * 0.5 + 1.25 for i in range(16)]),
                                                       "OUTPUT1": pytest.approx([i * 0.5 - 1.25 for i in range(16)])}


def test_bad_bodies_are_answered_in_place_with_the_http_error(env):
    _, _, _, here, _ = env
    answers = by_id(here)
    statuses = {cid: r["response"]["status_code"] for cid, r in answers.items()}
    assert {cid: s for cid, s in statuses.items() if s != 200} == REFUSED
    assert "no_such_model" in answers["bad-model"]["response"]["body"]["error"]["message"]
    assert "INPUT0" in answers["bad-shape"]["response"]["body"]["error"]


def test_every_output_line_parses_as_openai_batch_output(env):
    _, _, _, here, _ = env
    urls = {line["custom_id"]: line["url"] for line in LINES}
    for record in records(here):
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert isinstance(record["id"], str) and record["id"].startswith("batch_req_")
        assert record["error"] is None or BatchError.model_validate(record["error"])
        response = record["response"]
        assert isinstance(response["request_id"], str) and isinstance(response["status_code"], int)
        url, body = urls[record["custom_id"]], response["body"]
        if url.startswith("/v1/") and response["status_code"] >= 400:
            # Ferry's HTTP door (like vLLM's) sends the status as an int `code`; OpenAI's type says string
            error = ErrorObject.model_validate({**body["error"], "code": str(body["error"]["code"])})
            assert error.code == str(response["status_code"]) and error.message and error.type
        elif url == "/v1/chat/completions":
            parsed = ChatCompletion.model_validate(body)
            assert parsed.choices[0].message.content and parsed.usage.completion_tokens > 0
        elif url == "/v1/completions":
            expected = "stop" if record["custom_id"] == "cmpl-choice" else "length"  # a choice ends when it is complete
            assert Completion.model_validate(body).choices[0].finish_reason == expected
    logprobs = ChatCompletion.model_validate(by_id(here)["chat-logprobs"]["response"]["body"]).choices[0].logprobs
    assert len(logprobs.content) == 5 and all(len(t.top_logprobs) == 2 for t in logprobs.content)


def test_url_sends_the_same_lines_to_a_running_server(env, tmp_path):
    _, server, source, here, _ = env
    there = tmp_path / "remote.jsonl"
    done = ferry_batch("-i", source, "-o", there, "--url", server.http_url, "--max-in-flight", 8)
    assert done.returncode == 0, done.stderr
    assert f"ferry batch: {len(LINES)} requests" in done.stderr
    expected = {cid: same(r["response"]) for cid, r in by_id(here).items()}
    assert {cid: same(r["response"]) for cid, r in by_id(there).items()} == expected
    again = ferry_batch("-i", source, "-o", there, "--url", server.http_url)  # resumed: nothing left to send
    assert again.returncode == 0 and f"{len(LINES)} already in {there}" in again.stderr
    assert len(records(there)) == len(LINES)


def test_grpc_url_sends_every_path_over_grpc_and_answers_as_in_process(env, tmp_path):
    """infer through ModelInfer; generate, completions and chat through Generate (chat rendered by the server's
    template); each answer, refusals included, is the in-process (HTTP API) answer."""
    _, server, source, here, _ = env
    there = tmp_path / "grpc.jsonl"
    done = ferry_batch("-i", source, "-o", there, "--url", f"grpc://{server.address}", "--max-in-flight", 8)
    assert done.returncode == 0, done.stderr
    expected = {cid: same(r["response"]) for cid, r in by_id(here).items()}
    assert {cid: same(r["response"]) for cid, r in by_id(there).items()} == expected
    answer = by_id(there)["chat-json"]["response"]["body"]["choices"][0]["message"]["content"]
    assert json.loads(answer)["n"] in (1, 2, 3)  # the schema travelled over gRPC
    assert by_id(there)["cmpl-choice"]["response"]["body"]["choices"][0]["text"] in ("north", "south")
    chat_body = by_id(there)["chat-2"]["response"]["body"]
    assert chat_body["object"] == "chat.completion" and chat_body["usage"]["completion_tokens"] == 4 + 2 % 6


def test_a_bare_grpc_address_is_the_grpc_door(env, tmp_path):
    _, server, _, here, _ = env
    picked = [line for line in LINES if line["custom_id"] in ("infer-2", "chat-5", "gen-excluded", "bad-model")]
    source = write_jsonl(tmp_path / "input.jsonl", picked)
    there = tmp_path / "bare.jsonl"
    done = ferry_batch("-i", source, "-o", there, "--url", server.address)  # HOST:PORT, as tritonclient takes it
    assert done.returncode == 0, done.stderr
    expected = by_id(here)
    assert {cid: same(r["response"]) for cid, r in by_id(there).items()} == \
        {line["custom_id"]: same(expected[line["custom_id"]]["response"]) for line in picked}


def test_grpc_url_refuses_lines_with_no_grpc_equivalent_before_anything_runs(env, tmp_path):
    _, server, _, _, _ = env
    lines = [LINES[0],
             request("tensors-by-name", "/v2/models/simple/generate", {"INPUT0": [1.0] * 16, "INPUT1": [1.0] * 16}),
             LINES[1],
             request("named", "/v1/chat/completions",
                     {**chat(1), "messages": [{"role": "user", "content": "hi", "name": "ann"}]}),
             request("negative-seed", "/v1/completions", completion(1, seed=-3))]
    source = write_jsonl(tmp_path / "input.jsonl", lines)
    output = tmp_path / "output.jsonl"
    output.write_bytes(b"")
    done = ferry_batch("-i", source, "-o", output, "--url", f"grpc://{server.address}")
    assert done.returncode == 2, done.stderr
    problems = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith("line ")]
    assert len(problems) == 3, done.stderr
    assert problems[0].startswith("line 2: /v2/models/simple/generate:") and "text_input" in problems[0]
    assert problems[1].startswith("line 4: /v1/chat/completions:") and "messages[0] has name" in problems[1]
    assert problems[2].startswith("line 5: /v1/completions:") and "negative seed" in problems[2]
    assert output.read_bytes() == b""
    again = ferry_batch("-i", source, "-o", output, "--url", server.http_url)  # over HTTP the same file runs
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8001", "127.0.0.1", "grpc://127.0.0.1"])
def test_url_takes_an_http_or_a_grpc_address(url, tmp_path):
    source = write_jsonl(tmp_path / "input.jsonl", LINES[:1])
    done = ferry_batch("-i", source, "-o", tmp_path / "output.jsonl", "--url", url)
    assert done.returncode == 2 and "grpc://HOST:PORT" in done.stderr and "http://HOST:PORT" in done.stderr
    assert not (tmp_path / "output.jsonl").exists()


@pytest.mark.parametrize("scheme", ["http://", "grpc://"])
def test_url_with_no_server_answering_writes_nothing_and_exits_1(scheme, tmp_path):
    source = write_jsonl(tmp_path / "input.jsonl", LINES[:3])
    output = tmp_path / "output.jsonl"
    with socket.socket() as bound:  # bound, not listening: connections are refused, and no one else gets the port
        bound.bind(("127.0.0.1", 0))
        done = ferry_batch("-i", source, "-o", output, "--url", f"{scheme}127.0.0.1:{bound.getsockname()[1]}")
    assert done.returncode == 1, done.stderr
    assert "3 unanswered" in done.stderr and "left for a rerun" in done.stderr
    assert output.read_bytes() == b""


INVALID = [
    "{not json",
    "[1, 2]",
    json.dumps(request("x-audio", "/v1/audio/transcriptions", {"input": "a"})),
    json.dumps({**request("x-get", "/v1/completions", completion(1)), "method": "GET"}),
    json.dumps({"custom_id": "x-nobody", "method": "POST", "url": "/v1/completions"}),
    json.dumps(request("chat-0", "/v1/chat/completions", chat(0))),  # the first line's custom_id again
    json.dumps(request("x-stream", "/v1/completions", completion(1, stream=True))),
]


def test_invalid_files_are_refused_whole_naming_lines_and_nothing_is_written(env, tmp_path):
    repo = env[0]
    source = tmp_path / "input.jsonl"
    source.write_text(json.dumps(LINES[0]) + "\n" + "\n".join(INVALID) + "\n" + json.dumps(LINES[1]) + "\n")
    existing = tmp_path / "existing.jsonl"
    previous = (json.dumps({"id": "batch_req_0", "custom_id": "earlier", "response": None, "error": None}) + "\n"
                + '{"id": "batch_req_1", "custom_id": "torn').encode()  # a killed run's torn last line stays as it is
    existing.write_bytes(previous)
    for output in (existing, tmp_path / "absent.jsonl"):
        done = ferry_batch("-i", source, "-o", output, "--model-repository", repo)
        assert done.returncode == 2
        problems = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith("line ")]
        assert [p.split(":")[0] for p in problems] == [f"line {n}" for n in range(2, 9)], done.stderr
        for number, words in ((2, "not JSON"), (3, "not a JSON object"), (4, "unsupported url '/v1/audio/transcriptions'"),
                              (5, 'method must be "POST"'), (6, "missing body"), (7, "duplicate custom_id 'chat-0' (first on line 1)"),
                              (8, "stream")):
            assert words in problems[number - 2], problems[number - 2]
    assert existing.read_bytes() == previous
    assert not (tmp_path / "absent.jsonl").exists()


def gated_lines() -> list[dict]:
    held = [request(f"gated-{i}", "/v2/models/gated/infer", {"inputs": [tensor("X", [[float(i), 1.0 - 2 * (i == 3)]])]})
            for i in range(6)]  # gated-3 holds a negative value: it waits for the gate
    return [*held, *(request(f"kill-cmpl-{i}", "/v1/completions", completion(i + 20)) for i in range(6))]


def without_turn(response: dict) -> object:
    body = response["body"]
    if "outputs" in body:
        body = {**body, "outputs": [o for o in body["outputs"] if o["name"] != "TURN"]}
    return same({**response, "body": body})


def test_sigkill_mid_run_then_a_rerun_answers_each_custom_id_once(env, tmp_path):
    repo, _, _, _, gate = env
    source = write_jsonl(tmp_path / "input.jsonl", gated_lines())
    output = tmp_path / "output.jsonl"
    held = Path(str(gate) + ".running")
    run = subprocess.Popen([sys.executable, "-m", "server", "batch", "-i", source, "-o", output, "--model-repository",
                            repo], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: held.exists() and output.exists() and output.read_bytes().count(b"\n") >= 1, 120,
                 "the gated request to be held with some answers written")
    finally:
        run.kill()
        run.wait()
    first = {json.loads(line)["custom_id"] for line in output.read_bytes().split(b"\n")[:-1]}  # whole lines
    assert "gated-3" not in first
    with open(output, "ab") as out:
        out.write(b'{"id":"batch_req_torn","custom_id":"gated-4","resp')  # as if killed mid-write
    gate.touch()
    rerun = ferry_batch("-i", source, "-o", output, "--model-repository", repo)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(first)} already in" in rerun.stderr and "torn last line" in rerun.stderr
    answers = by_id(output)
    assert set(answers) == {line["custom_id"] for line in gated_lines()}
    clean = tmp_path / "clean.jsonl"
    assert ferry_batch("-i", source, "-o", clean, "--model-repository", repo).returncode == 0
    assert {cid: without_turn(r["response"]) for cid, r in answers.items()} == \
        {cid: without_turn(r["response"]) for cid, r in by_id(clean).items()}
    assert answers["gated-3"]["response"]["body"]["outputs"][0]["data"] == [3.0, -1.0]


def test_ray_local_with_two_actors_equals_in_process(env, tmp_path):
    pytest.importorskip("ray.data", reason="ray is an optional extra (pip install -e '.[ray]'), not in the test extra")
    repo, _, source, here, _ = env
    there = tmp_path / "ray.jsonl"
    done = ferry_batch("-i", source, "-o", there, "--model-repository", repo, "--ray", "local", "--ray-actors", 2,
                       "--ray-batch-size", 4)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = {cid: same(r["response"]) for cid, r in by_id(here).items()}
    assert {cid: same(r["response"]) for cid, r in by_id(there).items()} == expected


def shard_answers(folder: Path) -> dict[str, dict]:
    """Every shard's lines by custom_id, each custom_id once across the shards."""
    found = [json.loads(line) for shard in sorted(folder.glob("*.jsonl")) for line in shard.read_text().splitlines()]
    ids = [r["custom_id"] for r in found]
    assert len(ids) == len(set(ids)), "a custom_id answered twice across shards"
    return {r["custom_id"]: r for r in found}


def earlier_shard(folder: Path, here: Path, ids: list[str]) -> Path:
    """A shard an interrupted run left: some answers, then a torn last line."""
    folder.mkdir()
    answers = by_id(here)
    shard = folder / "part-earlier.jsonl"
    shard.write_bytes(b"".join(json.dumps(answers[i]).encode() + b"\n" for i in ids) + b'{"id":"batch_req_torn","cust')
    return shard


def test_output_folder_gets_one_shard_per_run_and_resumes_from_every_shard(env, tmp_path):
    repo, _, _, here, _ = env
    picked = [line for line in LINES if line["custom_id"] in ("infer-1", "infer-2", "cmpl-3", "chat-1", "gen-0", "bad-shape")]
    source = write_jsonl(tmp_path / "input.jsonl", picked)
    folder = tmp_path / "answers"
    earlier = earlier_shard(folder, here, ["infer-1", "chat-1"])
    done = ferry_batch("-i", source, "-o", f"{folder}/", "--model-repository", repo)
    assert done.returncode == 0, done.stderr
    assert "2 already in" in done.stderr and "torn last line" in done.stderr
    assert len(list(folder.glob("*.jsonl"))) == 2 and earlier.read_bytes().endswith(b"\n")  # the torn line cut off
    expected = {line["custom_id"]: same(by_id(here)[line["custom_id"]]["response"]) for line in picked}
    assert {cid: same(r["response"]) for cid, r in shard_answers(folder).items()} == expected
    again = ferry_batch("-i", source, "-o", folder, "--model-repository", repo)  # an existing folder, no slash
    assert again.returncode == 0 and f"{len(picked)} already in" in again.stderr
    assert len(list(folder.glob("*.jsonl"))) == 2
    a_file = tmp_path / "file.jsonl"
    a_file.write_text("")
    refused = ferry_batch("-i", source, "-o", f"{a_file}/", "--model-repository", repo)
    assert refused.returncode == 2 and "is a file" in refused.stderr


def test_ray_local_into_a_folder_writes_one_shard_per_block_and_resumes(env, tmp_path):
    pytest.importorskip("ray.data", reason="ray is an optional extra (pip install -e '.[ray]'), not in the test extra")
    repo, _, source, here, _ = env
    folder = tmp_path / "shards"
    earlier_shard(folder, here, ["chat-0", "infer-1", "bad-model"])
    done = ferry_batch("-i", source, "-o", f"{folder}/", "--model-repository", repo, "--ray", "local",
                       "--ray-actors", 2, "--ray-batch-size", 4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 already in" in done.stderr
    new = [shard for shard in folder.glob("*.jsonl") if shard.name != "part-earlier.jsonl"]
    sizes = [len(shard.read_text().splitlines()) for shard in new]
    assert len(new) >= 2 and max(sizes) <= 4 and sum(sizes) == len(LINES) - 3, sizes
    expected = {cid: same(r["response"]) for cid, r in by_id(here).items()}
    assert {cid: same(r["response"]) for cid, r in shard_answers(folder).items()} == expected
    assert f"ferry batch: {len(LINES) - 3} requests" in done.stderr
    again = ferry_batch("-i", source, "-o", folder, "--model-repository", repo, "--ray", "local")
    assert again.returncode == 0 and f"{len(LINES)} already in" in again.stderr


def test_tool_calls_in_a_batch_file(env, tmp_path):
    """In process, a line with tools is answered as the HTTP API answers it; over gRPC it is refused
    before anything runs (Generate carries no tools)."""
    repo, server, _, _, _ = env
    tools = [{"type": "function", "function": {"name": "flag", "parameters": FLAG}}]
    body = chat(1, tools=tools, tool_choice={"type": "function", "function": {"name": "flag"}}, max_tokens=40,
                ignore_eos=False)
    source = write_jsonl(tmp_path / "input.jsonl", [request("tool", "/v1/chat/completions", body)])
    done = ferry_batch("-i", source, "-o", tmp_path / "out.jsonl", "--model-repository", repo)
    assert done.returncode == 0, done.stderr
    answered = by_id(tmp_path / "out.jsonl")["tool"]["response"]["body"]
    call = answered["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "flag" and set(json.loads(call["function"]["arguments"])) == {"ok", "n"}
    assert same(answered) == same(http_answer(server, "/v1/chat/completions", body)[1])  # (call ids aside)
    refused = ferry_batch("-i", source, "-o", tmp_path / "grpc.jsonl", "--url", f"grpc://{server.address}")
    assert refused.returncode == 2 and "tool calling" in refused.stderr
