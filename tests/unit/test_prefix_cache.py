"""Prefix caching in the real continuous scheduler and KV pool, driven with made-up model outputs.

After every step the pool's invariant is checked against the running sequences: each reference count
equals the block tables holding the block, none is negative, a shared block is full and computed in
every sequence holding it (so it is never written), and every block is referenced xor free xor idle.
"""

from __future__ import annotations

import random

from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence, SeqStatus

_ids = iter(range(10**6))
SYSTEM = list(range(100, 112))  # three blocks of 4 tokens


def seq(prompt: list[int], max_tokens: int = 4, priority: int = 1) -> Sequence:
    return Sequence(next(_ids), list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens), priority=priority)


def scheduler(blocks=64, block_size=4, budget=64, max_seqs=8, margin=0, caching=True) -> ContinuousScheduler:
    settings = ContinuousSettings(max_seqs, budget, 256, 100, margin)
    return ContinuousScheduler(settings, KVBlockPool(blocks, block_size, prefix_caching=caching))


def step(s: ContinuousScheduler, token: int = 7):
    plan = s.schedule()
    sampled = {q.seq_id: token for q, n in plan.entries if q.num_computed + n == q.num_tokens}
    s.postprocess(plan, sampled)
    s.pool.check(s.running)
    return plan


def run_all(s: ContinuousScheduler, limit: int = 200) -> None:
    for _ in range(limit):
        if not (s.running or s.num_waiting):
            break
        step(s)
    assert not s.running and not s.num_waiting
    s.pool.check([])
    assert s.pool.num_free == s.pool.num_blocks  # every count is back to 0 (idle blocks count as free)


def test_a_shared_prefix_is_computed_once_and_its_blocks_are_shared():
    s = scheduler()
    first = seq(SYSTEM + [1, 2], max_tokens=3)
    s.submit(first)
    step(s)
    second = seq(SYSTEM + [5, 6, 7], max_tokens=3)
    s.submit(second)
    plan = step(s)
    assert (second, 3) in plan.entries  # only its own part: 12 of its 15 tokens came from the cache
    assert second.block_table[:3] == first.block_table[:3]
    assert second.block_table[3] != first.block_table[3]
    stats = s.pool.cache.stats
    assert (stats.query_tokens, stats.hit_tokens, stats.query_blocks, stats.hit_blocks) == (14 + 15, 12, 3 + 3, 3)
    run_all(s)


def test_the_last_prompt_token_is_always_computed_so_the_step_samples():
    s = scheduler()
    s.submit(seq(SYSTEM + [1], max_tokens=1))
    run_all(s)
    again = seq(SYSTEM, max_tokens=2)  # block-aligned and wholly cached
    s.submit(again)
    plan = step(s)
    assert plan.entries == [(again, 4)]  # its last block is recomputed, in a block of its own
    assert again.num_output == 1
    run_all(s)


def test_finished_blocks_stay_cached_until_the_pool_needs_them_then_least_recently_used_go_first():
    s = scheduler(blocks=8)
    old, recent = seq([1] * 8 + [9], max_tokens=1), seq([2] * 8 + [9], max_tokens=1)
    for q in (old, recent):
        s.submit(q)
        run_all(s)
    assert len(s.pool.cache) == 4 and s.pool.num_free == 8  # idle cached blocks count as free
    big = seq(list(range(300, 320)), max_tokens=1)  # 5 blocks: the 4 plain free ones, then one eviction
    s.submit(big)
    step(s)
    assert s.pool.cache.stats.evictions == 1
    assert len(s.pool.match(seq(recent.token_ids[:9]))) == 2  # the recently used prefix is whole
    assert len(s.pool.match(seq(old.token_ids[:9]))) == 1  # old's deepest block went first, its head stays
    run_all(s)


def test_admission_counts_only_the_blocks_and_budget_still_to_compute():
    for caching in (True, False):
        s = scheduler(blocks=6, budget=6, caching=caching)
        sharer = seq(SYSTEM + [1], max_tokens=8)
        s.submit(sharer)
        while sharer.num_output == 0:
            step(s)
        assert len(sharer.block_table) == 4 and s.pool.num_free == 2
        hungry = seq(SYSTEM + [5, 6, 7, 8], max_tokens=1)  # 16 tokens: 4 blocks and 16 tokens of budget
        s.submit(hungry)
        plan = step(s)
        if caching:  # 3 blocks shared, so 1 new block and 4 tokens: all of it in this step
            assert (hungry, 4) in plan.entries and hungry.num_output == 1
        else:  # a first chunk of what the budget leaves, no token yet
            assert (hungry, 5) in plan.entries and hungry.num_output == 0
        run_all(s)


def test_without_caching_the_same_prompt_is_computed_again():
    s = scheduler(caching=False)
    s.submit(seq(SYSTEM + [1], max_tokens=1))
    run_all(s)
    again = seq(SYSTEM + [2], max_tokens=1)
    s.submit(again)
    plan = step(s)
    assert plan.entries == [(again, 13)] and len(s.pool.cache) == 0
    run_all(s)


def test_cancelling_one_of_two_sharing_sequences_leaves_the_other_whole():
    s = scheduler()
    a, b = seq(SYSTEM + [1], max_tokens=6), seq(SYSTEM + [2], max_tokens=6)
    s.submit(a)
    step(s)
    s.submit(b)
    step(s)
    shared = a.block_table[:3]
    assert b.block_table[:3] == shared and all(s.pool._refs[x] == 2 for x in shared)
    a.cancelled = True
    assert s.drop_cancelled() == [a] and a.block_table == []
    s.pool.check(s.running)
    assert all(s.pool._refs[x] == 1 for x in shared) and b.block_table[:3] == shared
    run_all(s)
    assert b.finish_reason == "length" and b.num_output == 6


def test_preemption_with_shared_blocks_resumes_from_its_own_cached_blocks():
    s = scheduler(blocks=10, block_size=2, budget=100)
    first, second = seq(SYSTEM[:6] + [1], max_tokens=12), seq(SYSTEM[:6] + [2], max_tokens=12)
    s.submit(first)
    step(s)
    s.submit(second)
    for _ in range(20):
        step(s)
        if s.preemptions:
            break
    assert s.preemptions == 1 and second.status is SeqStatus.WAITING and second.block_table == []
    assert all(s.pool._refs[x] == 1 for x in first.block_table)  # the shared blocks lost one reference
    generated = second.num_output
    s.finish(first, "length")
    plan = step(s)
    resumed = dict((q.seq_id, n) for q, n in plan.entries)[second.seq_id]
    assert resumed < 7 + generated  # its prompt and generated blocks came back from the cache
    assert second.num_output == generated + 1
    run_all(s)


def test_random_traffic_keeps_every_count_right():
    """Shared prefixes, a pool small enough to preempt and evict, cancellations: the invariant holds
    after every step and every count returns to 0."""
    rng = random.Random(17)
    s = scheduler(blocks=24, block_size=4, budget=24, max_seqs=6, margin=1)
    prefixes = [list(range(i * 50, i * 50 + rng.randrange(4, 20))) for i in range(3)]
    live = []
    for _ in range(300):
        if rng.random() < 0.5 and s.num_waiting < 10:
            q = seq(rng.choice(prefixes) + [rng.randrange(2, 40) for _ in range(rng.randrange(1, 9))],
                    max_tokens=rng.randrange(1, 12))
            s.submit(q)
            live.append(q)
        if live and rng.random() < 0.05:
            rng.choice(live).cancelled = True
            s.drop_cancelled()
            s.pool.check(s.running)
        step(s, token=rng.randrange(2, 40))
    for q in live:
        q.cancelled = True
    s.drop_cancelled()
    run_all(s)
    stats = s.pool.cache.stats
    assert s.preemptions > 0 and stats.evictions > 0 and stats.hit_tokens > 0


def test_the_next_turn_of_a_chat_finds_the_previous_answers_blocks():
    """A finished sequence's generated tokens are cached too (every full block it computed), so a chat
    that resends prompt + answer + a new user part computes only the unfilled tail and the new part."""
    s = scheduler()
    turn = seq([1, 2, 3, 4, 5, 6], max_tokens=9)
    s.submit(turn)
    run_all(s)
    history = turn.token_ids  # 6 prompt + 9 generated; the last generated one was never fed, so 14 computed
    assert turn.finish_reason == "length" and len(history) == 15
    following = seq(history + [20, 21, 22, 23, 24], max_tokens=2)
    s.submit(following)
    plan = step(s)
    assert plan.entries == [(following, 20 - 12)]  # three full blocks: the prompt and six generated tokens
    assert following.num_computed == 20 and s.pool.cache.stats.hit_tokens == 12
