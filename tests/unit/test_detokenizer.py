"""Incremental detokenization and stop strings, with a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers", reason="tokenizers is a server dependency")

from server.backends.llm.tokenizer import IncrementalDetokenizer, StopStrings, TextTokenizer
from tests.llm_builders import build_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return TextTokenizer(folder)


def test_multibyte_characters_are_never_split(tok):
    text = " 🚢⚓ ünïcödé wörds, then ascii"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters really span several tokens
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    deltas = [detok.add(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert any(d == "" for d in deltas)  # a token that ends mid-character waits for the next one


def test_stop_strings_hold_back_possible_starts_and_cut_at_the_stop():
    stops = StopStrings(("END", "\n\n"))
    assert stops.feed("hello E") == ("hello ", False)  # "E" may start "END": held back
    assert stops.feed("x") == ("Ex", False)  # it did not
    assert stops.feed(" done\n") == (" done", False)
    assert stops.feed("\nmore") == ("", True)  # "\n\n" reached: nothing after it is sent
    assert StopStrings(()).feed("anything") == ("anything", False)
    tail = StopStrings(("END",))
    tail.feed("almost EN")
    assert tail.flush() == "EN"  # at a length/eos finish the held text is released
