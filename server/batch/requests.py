"""The input file: OpenAI's Batch format, one request a line, checked whole before anything runs.

A line is `{"custom_id": str, "method": "POST", "url": PATH, "body": {...}}`. The file is read as a
stream twice: once to validate every line (as OpenAI validates an upload, so a bad file is refused
before a single request runs or a byte of the output changes), once to run it. Duplicates are found
through 16-byte digests of the ids, so a file of many millions of lines keeps a small index.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v2/models/{name}/infer", "/v2/models/{name}/generate")
_URL = re.compile(r"/v1/chat/completions|/v1/completions|/v1/embeddings|/v2/models/[^/]+(?:/versions/[0-9]+)?/(?:infer|generate)")
MAX_SHOWN = 20  # problems listed before "... and N more"


@dataclass(frozen=True, slots=True)
class Line:
    number: int  # 1-based, as an editor shows it
    custom_id: str
    url: str
    body: dict
    payload: str = ""  # the body's JSON text as the line holds it: what is POSTed, never encoded again

    @property
    def data(self) -> bytes:
        return (self.payload or json.dumps(self.body)).encode()


class InvalidInputFile(Exception):
    """The file has lines that cannot run; `problems` name them by line number."""

    def __init__(self, path: Path, problems: list[str], count: int):
        self.problems, self.count = problems, count
        shown = "\n".join(f"  {p}" for p in problems)
        more = f"\n  ... and {count - len(problems)} more" if count > len(problems) else ""
        super().__init__(f"{path}: {count} invalid line(s), nothing was run:\n{shown}{more}")


def parse(number: int, text: str) -> Line:
    """One line as a request, or ValueError saying what is wrong with it."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    missing = [key for key in ("custom_id", "method", "url", "body") if key not in value]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    custom_id, method, url, body = value["custom_id"], value["method"], value["url"], value["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if method != "POST":
        raise ValueError(f"method must be \"POST\", got {str(method)[:40]!r}")
    if not isinstance(url, str) or not _URL.fullmatch(url):
        raise ValueError(f"unsupported url {str(url)[:80]!r}; supported: {', '.join(URLS)}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    if body.get("stream"):
        raise ValueError("body asks for a stream; a batch answers each request whole (drop \"stream\")")
    return Line(number, custom_id, url, body)


def _texts(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8", errors="strict") as lines:
        for number, text in enumerate(lines, 1):
            if text.strip():  # blank lines (a trailing one, say) carry no request
                yield number, text


def validate(path: Path, done: set[str] | frozenset[str] = frozenset(),
             check: Callable[[str, dict], str | None] | None = None) -> tuple[int, int]:
    """Check every line; returns the number of requests and how many of them `done` holds, or raises
    InvalidInputFile naming the bad lines. `check(url, body)`: why a line cannot run where it is going
    (a path with no gRPC equivalent, say), or None."""
    seen: dict[bytes, int] = {}
    problems, bad, count, already = [], 0, 0, 0
    try:
        for number, text in _texts(path):
            try:
                line = parse(number, text)
                reason = check(line.url, line.body) if check is not None else None
                if reason:
                    raise ValueError(f"{line.url}: {reason}")
                key = hashlib.blake2b(line.custom_id.encode(), digest_size=16).digest()
                first = seen.setdefault(key, number)
                if first != number:
                    raise ValueError(f"duplicate custom_id {line.custom_id[:80]!r} (first on line {first})")
                count += 1
                already += line.custom_id in done
            except ValueError as exc:
                bad += 1
                if len(problems) < MAX_SHOWN:
                    problems.append(f"line {number}: {exc}")
    except UnicodeDecodeError as exc:
        raise InvalidInputFile(path, [*problems, f"not UTF-8 text ({exc})"], bad + 1) from None
    if bad:
        raise InvalidInputFile(path, problems, bad)
    return count, already


def requests(path: Path, skip: set[str] | frozenset[str] = frozenset()) -> Iterator[Line]:
    """The file's requests in order (a validated file), less those whose custom_id is in `skip`."""
    for number, text in _texts(path):
        line = runnable(number, text)
        if line.custom_id not in skip:
            yield line


def runnable(number: int, text: str) -> Line:
    """A line of a validated file, read in one pass that keeps the body's own text (re-encoding a body of
    numbers costs more than the rest of a line's work together)."""
    fields = _fields(text)
    body, start, end = fields["body"]
    return Line(number, fields["custom_id"][0], fields["url"][0], body, text[start:end])


_SPACE = re.compile(r"[ \t\n\r]*")
_scan = json.JSONDecoder().scan_once


def _fields(text: str) -> dict[str, tuple[object, int, int]]:
    """A JSON object's top-level keys -> (value, start, end of the value's text); the object is known valid."""
    fields = {}
    at = _SPACE.match(text, _SPACE.match(text).end() + 1).end()  # past "{"
    while text[at] != "}":
        key, at = json.decoder.scanstring(text, at + 1)
        start = _SPACE.match(text, _SPACE.match(text, at).end() + 1).end()  # past ":"
        value, end = _scan(text, start)
        fields[key] = (value, start, end)
        at = _SPACE.match(text, end).end()
        if text[at] == ",":
            at = _SPACE.match(text, at + 1).end()
    return fields
