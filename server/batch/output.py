"""The output: one OpenAI batch-output line per answered custom_id, appended as answers come.

OUTPUT is one file, or a folder of shard files (`-o DIR/`: every `*.jsonl` in it is a shard; each run
or Ray batch adds its own). It is the run's own progress record. Each line goes out in one `write` on
a descriptor opened for appending, so a run killed at any moment (SIGKILL included) leaves whole lines
plus at most one torn last line per file; `read_answered` finds the ids already done, which a rerun
skips, and `drop_torn` cuts those lines off.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import time
import uuid
from pathlib import Path

log = logging.getLogger("ferry.batch")


class OutputFileError(Exception):
    """OUTPUT exists but is not a batch output file this command can resume into."""


SHARD_GLOB = "*.jsonl"


def shards(folder: Path) -> list[Path]:
    return sorted(p for p in folder.glob(SHARD_GLOB) if p.is_file())


def read_answered_in(output: Path, folder: bool) -> tuple[set[str], dict[Path, int]]:
    """`read_answered` over OUTPUT, a file or every shard of a folder: the ids done, and each file's whole length."""
    done, kept = set(), {}
    for path in shards(output) if folder else [output]:
        found, kept[path] = read_answered(path)
        done |= found
    return done, kept


def read_answered(path: Path) -> tuple[set[str], int]:
    """The custom_ids OUTPUT already answers and the length of its whole lines (a torn last line, a
    killed run's, lies past it). Reads only: an invalid input must leave OUTPUT as it was."""
    if not path.exists():
        return set(), 0
    done, kept = set(), 0
    with open(path, "rb") as lines:
        for number, raw in enumerate(lines, 1):
            custom_id = _custom_id(raw) if raw.endswith(b"\n") else None
            if custom_id is None:
                if lines.read(1):  # something follows: not a torn tail but a damaged file
                    raise OutputFileError(f"{path} line {number} is not a batch output line; "
                                          "give another --output or repair the file")
                break
            done.add(custom_id)
            kept += len(raw)
    return done, kept


def drop_torn(path: Path, kept: int) -> None:
    """Cut OUTPUT back to its whole lines, so the next answer starts a line of its own."""
    if path.exists() and path.stat().st_size > kept:
        log.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", path,
                    path.stat().st_size - kept)
        os.truncate(path, kept)


def _custom_id(raw: bytes) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


_ids = random.Random()  # ids need to be unique, not secret: no system call per line
_USAGE = re.compile(rb'"usage":\{"prompt_tokens":(\d+),"completion_tokens":(\d+)')
_LINE = ('{"id":"batch_req_%032x","custom_id":%s,"response":{"status_code":%d,"request_id":"req_%032x","body":%s},'
         '"error":null}')


def answer(custom_id: str, status: int, raw: bytes, trusted: bool) -> tuple[str, tuple[int, int]]:
    """OpenAI's batch output line for one answered request (HTTP errors included: `error` stays null), and
    the answer's (prompt, completion) token counts.

    `trusted`: `raw` is JSON from Ferry's own encoder in this process (compact, one line); it goes into
    the line as it is, so an answer is neither parsed nor encoded again. Anything else is parsed first
    (an answer that is not JSON, binary tensors say, is kept as a string)."""
    if trusted and b"\n" not in raw and b"\r" not in raw:
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            trusted = False
    if not trusted or b"\n" in raw or b"\r" in raw:
        body = parse_body(raw)
        text = _dumps(body)
        usage = body.get("usage") if isinstance(body, dict) else None
        counts = (int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)) \
            if isinstance(usage, dict) else (0, 0)
    else:
        found = _USAGE.findall(raw)  # in Ferry's answers usage comes last; a string's quotes are escaped
        counts = (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)
    line = _LINE % (_ids.getrandbits(128), _dumps(custom_id), status, _ids.getrandbits(128), text)
    return line, counts


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # one encoder, not one a line


def parse_body(raw: bytes):
    """The answer's JSON; an answer that is not JSON (none of Ferry's are) is kept as a string."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


class AnswerWriter:
    """Appends whole lines to OUTPUT. Lines are gathered and written together, whole lines in each `write`
    on a descriptor opened for appending, within FLUSH_S of the first one waiting (or once FLUSH_BYTES
    wait): a kill loses at most the lines not yet written, whose requests a rerun sends again, and tears
    at most the last line."""

    FLUSH_S, FLUSH_BYTES = 0.2, 1 << 16

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._pending: list[str] = []
        self._size, self._since = 0, 0.0

    def write_line(self, text: str) -> None:
        if not self._pending:
            self._since = time.monotonic()
        self._pending.append(text)
        self._size += len(text)
        if self._size >= self.FLUSH_BYTES or time.monotonic() - self._since >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data = ("\n".join(self._pending) + "\n").encode()
        self._pending, self._size = [], 0
        while data:
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        if self._fd >= 0:
            self.flush()
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> AnswerWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardWriter:
    """An AnswerWriter onto a new shard of a folder, created at its first line (a batch that answers nothing
    leaves no empty file)."""

    def __init__(self, folder: Path):
        self.path = folder / f"part-{uuid.uuid4().hex[:16]}.jsonl"
        self._writer: AnswerWriter | None = None

    def write_line(self, text: str) -> None:
        if self._writer is None:
            self._writer = AnswerWriter(self.path)
        self._writer.write_line(text)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Collected:
    """An AnswerWriter's stand-in that keeps the lines (a Ray actor returns them to the driver, which writes)."""

    def __init__(self):
        self.lines: list[str] = []

    def write_line(self, text: str) -> None:
        self.lines.append(text)

    def flush(self) -> None:
        pass
