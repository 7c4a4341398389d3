"""`ferry batch`'s files without an engine: whole-file validation, resume reading, torn lines, the
in-memory ASGI call, and the bounded in-flight loop (a sender the test holds)."""

from __future__ import annotations

import asyncio
import json

import pytest

from server.batch import asgi
from server.batch.output import AnswerWriter, Collected, OutputFileError, drop_torn, read_answered
from server.batch.progress import Tally
from server.batch.requests import InvalidInputFile, Line, requests, validate
from server.batch.run import Unanswered, run_lines


def line(custom_id: str, url: str = "/v1/completions", **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": {"prompt": "x"}, **extra})


def test_validate_counts_requests_and_those_already_answered(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line("a"), "", line("b", "/v2/models/m/versions/2/infer"),
                                 line("c", "/v2/models/m/generate")]) + "\n\n")
    assert validate(source, {"b", "zzz"}) == (3, 1)
    assert [(r.number, r.custom_id) for r in requests(source, {"a"})] == [(3, "b"), (4, "c")]


def test_validate_lists_every_bad_line_and_caps_the_list(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join([line("a")] + [line("a")] * 25 + [line("x", "/v2/models/m/ready")]) + "\n")
    with pytest.raises(InvalidInputFile) as caught:
        validate(source)
    assert caught.value.count == 26 and len(caught.value.problems) == 20
    assert caught.value.problems[0] == "line 2: duplicate custom_id 'a' (first on line 1)"
    assert "... and 6 more" in str(caught.value)


def test_read_answered_keeps_whole_lines_and_drop_torn_cuts_the_rest(tmp_path):
    output = tmp_path / "out.jsonl"
    with AnswerWriter(output) as writer:
        writer.write_line(json.dumps({"custom_id": "a", "response": None}))
        writer.write_line(json.dumps({"custom_id": "b", "response": None}))
    whole = output.read_bytes()
    output.write_bytes(whole + b'{"custom_id": "c", "resp')
    done, kept = read_answered(output)
    assert done == {"a", "b"} and kept == len(whole)
    assert output.read_bytes() == whole + b'{"custom_id": "c", "resp'  # reading changes nothing
    drop_torn(output, kept)
    assert output.read_bytes() == whole


def test_a_damaged_line_before_the_end_is_refused(tmp_path):
    output = tmp_path / "out.jsonl"
    output.write_text('{"custom_id": "a"}\nnot json\n{"custom_id": "b"}\n')
    with pytest.raises(OutputFileError, match="line 2"):
        read_answered(output)


async def _echo(scope, receive, send):
    message = await receive()
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/x-echo")]})
    await send({"type": "http.response.body", "body": scope["path"].encode() + b":", "more_body": True})
    await send({"type": "http.response.body", "body": message["body"]})
    assert (await receive())["type"] == "http.disconnect"  # after the answer, the client has gone


def test_asgi_call_collects_status_and_body():
    assert asyncio.run(asgi.call(_echo, "POST", "/p", b"{}")) == (201, b"/p:{}", "text/x-echo")


class HeldSender:
    """Answers only when the test releases; records the most requests it ever held at once."""

    def __init__(self):
        self.held, self.most, self.release = 0, 0, None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        self.held += 1
        self.most = max(self.most, self.held)
        await self.release.wait()
        self.held -= 1
        if json.loads(body)["prompt"] == "unreachable":
            raise Unanswered("connection refused")
        return (200, b'{"usage": {"completion_tokens": 2}}', False) if path == "/v1/completions" else (404, b'{"error": "no"}', False)


def test_run_lines_bounds_in_flight_and_writes_each_answer():
    async def main():
        sender = HeldSender()
        sender.release = asyncio.Event()
        lines = [*(json.loads(line(f"r{i}")) for i in range(10)), json.loads(line("gone")),
                 json.loads(line("missing", "/v2/models/m/infer"))]
        lines[10]["body"]["prompt"] = "unreachable"
        parsed = [Line(i + 1, d["custom_id"], d["url"], d["body"]) for i, d in enumerate(lines)]
        collected, tally = Collected(), Tally(len(parsed))
        task = asyncio.create_task(run_lines(sender, parsed, collected, tally, in_flight=3))
        for _ in range(1000):  # loop turns, not time: the three slots fill within a few
            if sender.held == 3:
                break
            await asyncio.sleep(0)
        assert sender.held == 3 and not task.done()
        sender.release.set()
        await task
        return sender, collected, tally

    sender, collected, tally = asyncio.run(main())
    assert sender.most == 3
    written = [json.loads(text) for text in collected.lines]
    assert sorted(r["custom_id"] for r in written) == sorted([*(f"r{i}" for i in range(10)), "missing"])
    assert (tally.ok, tally.refused, tally.unanswered, tally.completion_tokens) == (10, 1, 1, 20)


class Flaky:
    """503 (a full queue, say) for the first `fails` calls of each custom_id."""

    def __init__(self, fails: dict[str, int]):
        self.fails, self.calls = fails, {}

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, bool]:
        key = json.loads(body)["prompt"]
        self.calls[key] = self.calls.get(key, 0) + 1
        return (503, b'{"error": "queue full"}', True) if self.calls[key] <= self.fails[key] else (200, b"{}", True)


def test_a_503_is_retried_and_never_written_as_an_answer(monkeypatch):
    from server.batch import run

    monkeypatch.setattr(run, "RETRY_BACKOFF_S", (0.0, 0.0))
    lines = [Line(1, "passes", "/v1/completions", {"prompt": "a"}), Line(2, "stays", "/v1/completions", {"prompt": "b"})]
    sender, collected, tally = Flaky({"a": 2, "b": 99}), Collected(), Tally(2)
    asyncio.run(run_lines(sender, lines, collected, tally))
    assert [json.loads(text)["custom_id"] for text in collected.lines] == ["passes"]
    assert sender.calls == {"a": 3, "b": 3} and (tally.ok, tally.unanswered) == (1, 1)


TRICKY = [
    '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"x": [1, 2.5e-7, "\\u00e9\\"}"], "y": null}}\n',
    ' { "body" :{"b":{"c" : [ ]}} , "url":"/v1/completions","custom_id":"\\u00e9x","method":"POST" }\n',
    '{"custom_id":"a","body":{"first":1},"method":"POST","url":"/v1/completions","body":{"second":2}}',
]


@pytest.mark.parametrize("text", TRICKY)
def test_a_running_line_keeps_its_body_text_and_reads_as_validation_reads_it(text):
    from server.batch.requests import parse, runnable

    fast, checked = runnable(7, text), parse(7, text)
    assert (fast.custom_id, fast.url, fast.body) == (checked.custom_id, checked.url, checked.body)
    assert json.loads(fast.data) == checked.body and fast.payload in text


def test_a_trusted_answer_goes_in_as_it_is_and_reads_as_a_parsed_one():
    from server.batch.output import answer

    body = {"id": "chatcmpl-1", "choices": [{"message": {"content": 'é "usage":{"prompt_tokens":99,"completion_tokens":99'}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}
    raw = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    spliced, counts = answer("q-é", 200, raw, trusted=True)
    parsed, parsed_counts = answer("q-é", 200, raw, trusted=False)
    assert counts == parsed_counts == (7, 3)
    assert spliced.endswith(raw.decode() + '},"error":null}')  # not parsed, not encoded again
    a, b = json.loads(spliced), json.loads(parsed)
    assert a["id"] != b["id"] and a["id"].startswith("batch_req_") and a["response"]["request_id"].startswith("req_")
    for record in (a, b):
        del record["id"], record["response"]["request_id"]
    assert a == b == {"custom_id": "q-é", "response": {"status_code": 200, "body": body}, "error": None}
    binary, _ = answer("t", 200, b'{"outputs":[]}\x00\x01\xff', trusted=False)  # not JSON: kept as a string
    assert isinstance(json.loads(binary)["response"]["body"], str)


def test_the_writer_writes_gathered_lines_whole_and_everything_by_close(tmp_path):
    output = tmp_path / "out.jsonl"
    writer = AnswerWriter(output)
    writer.write_line('{"custom_id":"a"}')
    assert output.read_bytes() == b""  # gathered, not yet written
    writer.flush()
    assert output.read_bytes() == b'{"custom_id":"a"}\n'
    big = '{"custom_id":"b","pad":"' + "x" * AnswerWriter.FLUSH_BYTES + '"}'
    writer.write_line(big)  # past FLUSH_BYTES: written at once
    assert output.read_bytes().endswith(big.encode() + b"\n")
    writer.write_line('{"custom_id":"c"}')
    writer.close()
    assert output.read_bytes().endswith(b'\n{"custom_id":"c"}\n') and read_answered(output)[0] == {"a", "b", "c"}
