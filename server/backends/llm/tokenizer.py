"""Text <-> token ids, incremental detokenization and stop strings.

Decoding token by token breaks multi-byte characters and word-piece spacing, so each new piece of
text is the difference between decoding a short window of recent ids with and without the newest
ones; a window that ends in an incomplete character (U+FFFD) waits for the next token.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from server.errors import ConfigError

_WINDOW = 5


class TextTokenizer:
    def __init__(self, folder: Path):
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: tokenizer.json is missing")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.eos_token_ids = _eos_from_files(folder)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _eos_from_files(folder: Path) -> tuple[int, ...]:
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
    return ()


class IncrementalDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids)
        self.prefix_offset = max(len(self.ids) - _WINDOW, 0)
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Text that `token_id` completes (possibly empty while a character is unfinished)."""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held, even an incomplete character."""
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]


class StopStrings:
    """Holds back text that might be the start of a stop string, so a stop string is never half-sent."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was reached)."""
        if not self.stops:
            return text, False
        pending = self.held + text
        hits = [i for i in (pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return pending[: min(hits)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if pending.endswith(s[:k])), default=0)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
