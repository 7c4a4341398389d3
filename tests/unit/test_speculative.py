"""Prompt-lookup drafts and their verification in the scheduler, driven by a made-up deterministic model:
outputs equal decoding one token a step, KV blocks and prefix names only ever cover kept tokens."""

from __future__ import annotations

import random

import pytest

from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.ngram import propose
from server.scheduling.prefix_cache import prefix_hashes
from server.scheduling.sequence import SamplingParams, Sequence
from server.scheduling.speculative import Speculator, SpeculativeSettings, accepted


def brute_force(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence with a token after it
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_propose_equals_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 3, 8])) for _ in range(rng.randrange(0, 40))]
        k, max_n = rng.randrange(1, 6), rng.randrange(1, 6)
        min_n = rng.randrange(1, max_n + 1)
        assert propose(tokens, k, max_n, min_n) == brute_force(tokens, k, max_n, min_n), (tokens, k, max_n, min_n)


def test_propose_prefers_the_longest_suffix_then_the_latest_occurrence():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 5, 2, 3]
    assert propose(tokens, 2, 1, 1) == [8, 5]  # "3" last occurred at 5
    assert propose([7, 1, 2, 3, 4, 0, 2, 3, 5, 1, 2, 3], 3, 3, 1) == [4, 0, 2]  # "1 2 3" beats the later "2 3"
    assert propose(tokens, 2, 4, 3) == []  # no earlier "9 2 3"... only "2 3" (too short for min 3)
    assert propose([4, 4, 4], 5, 2, 1) == [4]  # overlapping the suffix; cut at the end of the history
    assert propose([], 3, 2, 1) == [] and propose([5], 3, 2, 1) == []


def test_accepted_keeps_agreeing_drafts_then_the_models_own_choice():
    assert accepted([1, 2, 3], [1, 2, 3, 4]) == [1, 2, 3, 4]
    assert accepted([1, 2, 3], [1, 5, 3, 4]) == [1, 5]
    assert accepted([1, 2, 3], [6, 2, 3, 4]) == [6]


def model(history: list[int]) -> int:
    """A deterministic 'model' that mostly loops (drafts get accepted) but breaks its loop every 7th
    position (drafts get rejected); its choice depends on the position, like attention's would."""
    last = history[-1]
    return (last * 5 + len(history)) % 13 + 2 if len(history) % 7 == 0 else (last * 3 + 1) % 11 + 2


def run(seqs: list[Sequence], speculate: int = 0, blocks=64, block_size=4, budget=32, caching=True, window=None):
    """Serve `seqs` to the end with `model`; check the pool after every step; return the scheduler."""
    speculator = Speculator(SpeculativeSettings(speculate, 3, 1)) if speculate else None
    s = ContinuousScheduler(ContinuousSettings(8, budget, 256, 100, 0, frozenset({1})),
                            KVBlockPool(blocks, block_size, caching, window=window), speculator)
    for q in seqs:
        s.submit(q)
    while s.running or s.num_waiting:
        plan = s.schedule()
        assert plan.num_tokens <= budget
        sampled = {}
        for q, n in plan.entries:
            drafts = plan.drafts.get(q.seq_id, [])
            if q.num_computed + n == q.num_tokens + len(drafts):
                choices = [model(q.token_ids + drafts[:j]) for j in range(len(drafts) + 1)]
                sampled[q.seq_id] = choices if drafts else choices[0]
        s.postprocess(plan, sampled)
        s.pool.check(s.running)
        for q in s.running:
            bs = s.pool.block_size
            assert len(q.block_table) <= s.pool.blocks_for(q.num_tokens)  # rejected drafts' blocks went back
            assert len(q.block_hashes) <= q.num_computed // bs  # only computed, kept tokens are ever named
            assert q.block_hashes == prefix_hashes(q.token_ids, bs, len(q.block_hashes))
    assert s.pool.num_used == 0
    return s


def requests(seed: int, count: int, **sampling) -> list[Sequence]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(2, 13) for _ in range(rng.randrange(3, 20))]
        out.append(Sequence(i, prompt, len(prompt), SamplingParams(**{"max_tokens": rng.randrange(1, 40), **sampling})))
    return out


@pytest.mark.parametrize("k", [1, 3, 8])
def test_outputs_equal_one_token_a_step_and_drafts_are_accepted(k):
    plain, drafted = requests(1, 6), requests(1, 6)
    run(plain)
    s = run(drafted, speculate=k)
    assert [q.output_ids for q in drafted] == [q.output_ids for q in plain]
    assert [q.finish_reason for q in drafted] == [q.finish_reason for q in plain] == ["length"] * 6
    assert all(q.num_output == q.sampling.max_tokens for q in drafted)
    stats = s.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # some kept, some rejected


def test_drafts_under_a_sliding_window_give_back_only_blocks_behind_it():
    """Rejected drafts trim blocks at the end while the window gives back blocks at the start: the pool's
    check (every given-back entry wholly behind the window, every count right) holds after every step."""
    plain, drafted = requests(5, 6, max_tokens=60), requests(5, 6, max_tokens=60)
    run(plain)
    s = run(drafted, speculate=3, blocks=24, window=6)
    assert [q.output_ids for q in drafted] == [q.output_ids for q in plain]
    assert s.speculator.stats.accepted_tokens > 0
    assert s.preemptions == 0  # 24 blocks hold six 60-80-token sequences only because blocks go back
    assert run(requests(5, 6, max_tokens=60), speculate=3, blocks=24).preemptions > 0  # as without a window


def test_stop_ids_and_eos_end_exactly_where_they_would_without_drafts():
    plain, drafted = requests(2, 6, stop_token_ids=(5,)), requests(2, 6, stop_token_ids=(5,))
    run(plain)
    run(drafted, speculate=4)
    assert [q.output_ids for q in drafted] == [q.output_ids for q in plain]
    assert "stop" in [q.finish_reason for q in plain]
    assert [q.finish_reason for q in drafted] == [q.finish_reason for q in plain]
    plain, drafted = requests(3, 6, min_tokens=3, stop_token_ids=(5,)), requests(3, 6, min_tokens=3, stop_token_ids=(5,))
    run(plain)
    run(drafted, speculate=4)
    assert [q.output_ids for q in drafted] == [q.output_ids for q in plain]


def test_drafts_use_only_what_the_step_leaves():
    # a tight pool and budget: drafts shrink or vanish, nobody is preempted for them
    plain, drafted = requests(4, 8), requests(4, 8)
    base = run(plain, blocks=24, budget=12)
    s = run(drafted, speculate=6, blocks=24, budget=12)
    assert [q.output_ids for q in drafted] == [q.output_ids for q in plain]
    assert s.preemptions <= base.preemptions


def test_without_prefix_caching_too():
    plain, drafted = requests(5, 4), requests(5, 4)
    run(plain, caching=False)
    run(drafted, speculate=3, caching=False)
    assert [q.output_ids for q in drafted] == [q.output_ids for q in plain]


def test_a_draft_is_never_past_max_tokens_or_max_model_len():
    q = Sequence(0, [3, 4, 3, 4, 3], 5, SamplingParams(max_tokens=3), num_computed=4)  # decoding
    spec = Speculator(SpeculativeSettings(8, 2, 1))
    drafts = spec.draft([(q, 1)], 100, lambda *_: True, max_model_len=100)
    assert drafts[0] == [4, 3]  # 3 tokens may still come: the model's own choice plus 2 drafts
    entries = [(q, 1)]
    assert spec.draft(entries, 100, lambda *_: True, max_model_len=7) == {0: [4]} and entries == [(q, 2)]
    assert spec.draft([(q, 1)], 100, lambda *_: False, max_model_len=100) == {}  # no room: no drafts
