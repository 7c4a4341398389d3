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


def answer_line(custom_id: str, status: int, body) -> dict:
    """OpenAI's batch output object for one answered request (HTTP errors included: `error` stays null)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{uuid.uuid4().hex}", "body": body},
            "error": None}


def parse_body(raw: bytes):
    """The answer's JSON; an answer that is not JSON (none of Ferry's are) is kept as a string."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


class AnswerWriter:
    """Appends whole lines to OUTPUT, each in one write, so none is ever interleaved or half-flushed."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        self.write_line(json.dumps(record, ensure_ascii=False, separators=(",", ":")))

    def write_line(self, text: str) -> None:
        data = (text + "\n").encode()
        while data:
            data = data[os.write(self._fd, data):]

    def close(self) -> None:
        if self._fd >= 0:
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

    def write(self, record: dict) -> None:
        if self._writer is None:
            self._writer = AnswerWriter(self.path)
        self._writer.write(record)

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

    def write(self, record: dict) -> None:
        self.lines.append(json.dumps(record, ensure_ascii=False, separators=(",", ":")))
