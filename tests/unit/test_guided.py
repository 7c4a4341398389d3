"""guided.py on a real tokenizer and llguidance: compiled once per constraint, masks of drafted rows equal
the masks of the same states reached one token at a time, a refused token leaves only eos, and a
constraint the engine cannot compile is the client's error."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer

from server.backends.llm import guided
from server.errors import InvalidInputError
from server.scheduling.sequence import Constraint
from tests import llm_builders

SCHEMA = Constraint("json", json.dumps({"type": "object", "properties": {"a": {"enum": ["xy", "yx"]}},
                                        "required": ["a"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def guides(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    vocab = llm_builders.build_tokenizer(folder)
    return guided.Guides(Tokenizer.from_file(str(folder / "tokenizer.json")), vocab + 7, (1,)), \
        Tokenizer.from_file(str(folder / "tokenizer.json"))


def allowed(mask_row: torch.Tensor, vocab: int) -> set[int]:
    logits = guided.apply(torch.zeros(1, vocab), [0], mask_row.unsqueeze(0))
    return set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())


def test_a_constraint_is_compiled_once(guides):
    g, _ = guides
    before = g.stats.compiles
    g.start(SCHEMA)
    g.start(Constraint("json", SCHEMA.spec))
    assert g.stats.compiles == before + 1


def test_drafted_rows_get_the_masks_of_their_states(guides):
    g, tok = guides
    ids = tok.encode('{"a":"xy"}').ids
    one_by_one = []
    guide = g.start(SCHEMA)
    for n in range(len(ids) + 1):
        one_by_one.append(allowed(g._fill([(guide, ids[:n])])[0], g.vocab_size))
    assert one_by_one[-1] == {1}  # the object is complete: only eos
    assert all(ids[n] in one_by_one[n] for n in range(len(ids)))
    drafted = g.start(SCHEMA)
    drafted.follow(ids[:2])
    masks = g._fill([(drafted, ids[:2 + j]) for j in range(4)])  # the real output, then three drafts
    assert [allowed(m, g.vocab_size) for m in masks] == one_by_one[2:6]
    assert drafted.consumed == 2  # the drafts were undone
    refused = g._fill([(drafted, ids[:2]), (drafted, ids[:2] + [tok.token_to_id("z")]), (drafted, ids[:2] + [5, 5])])
    assert allowed(refused[0], g.vocab_size) == one_by_one[2]
    assert allowed(refused[1], g.vocab_size) == {1} and allowed(refused[2], g.vocab_size) == {1}
    assert allowed(g._fill([(drafted, ids[:3])])[0], g.vocab_size) == one_by_one[3]  # not left broken


@pytest.mark.parametrize("parallel_rows", [0, 2])  # one thread, and llguidance's threads
def test_many_sequences_at_once_equal_each_alone(guides, parallel_rows):
    g, tok = guides
    g.parallel_rows = parallel_rows
    ids = tok.encode('{"a":"yx"}').ids
    alone = [allowed(g._fill([(g.start(SCHEMA), ids[:n])])[0], g.vocab_size) for n in range(5)]
    broken = g.start(SCHEMA)
    broken.follow([tok.token_to_id("z")])  # refused: eos only
    together = g._fill([(g.start(SCHEMA), ids[:n]) for n in range(5)] + [(broken, [tok.token_to_id("z")])])
    assert [allowed(m, g.vocab_size) for m in together] == alone + [{1}]


@pytest.mark.parametrize("constraint, named", [(Constraint("json", '{"type": "objectx"}'), "objectx"),
                                               (Constraint("regex", "a("), "regex"),
                                               (Constraint("grammar", "start: undefined_rule"), "undefined_rule")])
def test_what_cannot_compile_is_invalid_input(guides, constraint, named):
    g, _ = guides
    with pytest.raises(InvalidInputError, match=named):
        g.start(constraint)


def test_apply_masks_the_given_rows_only_bit_by_bit():
    vocab = 330  # not a multiple of 32: the last word's spare bits are never read
    mask = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    masked = guided.apply(torch.zeros(5, vocab), [0, 2, 4], mask)
    expected = [[bool((int(mask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
    assert torch.isfinite(masked[[0, 2, 4]]).tolist() == expected
    assert torch.isfinite(masked[[1, 3]]).all()
