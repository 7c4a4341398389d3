"""The continuous-batching scheduler and the KV block pool, driven with made-up model outputs."""

from __future__ import annotations

import pytest

from server.errors import InvalidInputError, QueueFullError
from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import RELEASED, KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence, SeqStatus

_ids = iter(range(10**6))


def seq(prompt_len: int, max_tokens: int = 8, priority: int = 1) -> Sequence:
    return Sequence(next(_ids), list(range(1, prompt_len + 1)), prompt_len, SamplingParams(max_tokens=max_tokens),
                    priority=priority)


def scheduler(blocks=64, block_size=4, max_seqs=8, budget=32, margin=0, max_len=256, max_waiting=100):
    settings = ContinuousSettings(max_seqs, budget, max_len, max_waiting, margin)
    return ContinuousScheduler(settings, KVBlockPool(blocks, block_size))


def step(s: ContinuousScheduler, token: int = 7):
    """Schedule one step and pretend the model sampled `token` for every sequence that caught up."""
    plan = s.schedule()
    sampled = {q.seq_id: token for q, n in plan.entries if q.num_computed + n == q.num_tokens}
    s.postprocess(plan, sampled)
    s.pool.check()
    return plan


def test_budget_serves_running_first_then_chunks_the_last_prompt():
    s = scheduler(budget=10)
    a, b = seq(6), seq(9)
    s.submit(a)
    s.submit(b)
    plan = step(s)
    assert [(q.seq_id, n) for q, n in plan.entries] == [(a.seq_id, 6), (b.seq_id, 4)]  # b's prompt is cut
    assert a.num_output == 1 and b.num_output == 0 and b.num_computed == 4
    plan = step(s)
    assert [(q.seq_id, n) for q, n in plan.entries] == [(a.seq_id, 1), (b.seq_id, 5)]  # decode + rest of b
    assert b.num_output == 1


def test_admission_limited_by_max_seqs_and_free_blocks():
    s = scheduler(blocks=4, block_size=4, max_seqs=2, budget=100)
    seqs = [seq(4, max_tokens=4) for _ in range(3)]
    for q in seqs:
        s.submit(q)
    plan = step(s)
    assert len(plan.entries) == 2 and s.num_waiting == 1  # max_num_seqs
    s2 = scheduler(blocks=3, block_size=4, budget=100, margin=1)
    big, small = seq(8, max_tokens=2), seq(4, max_tokens=2)
    s2.submit(big)
    s2.submit(small)
    step(s2)
    assert big.status is SeqStatus.RUNNING and small.status is SeqStatus.WAITING  # margin keeps one block free


def test_priority_then_arrival_order_for_admission():
    s = scheduler(max_seqs=1)
    low, high = seq(4, priority=2), seq(4, priority=1)
    s.submit(low)
    s.submit(high)
    plan = step(s)
    assert plan.entries[0][0] is high


def run_until_preemption(s: ContinuousScheduler, limit: int = 20):
    for _ in range(limit):
        plan = step(s)
        if s.preemptions:
            return plan
    raise AssertionError("no preemption happened")


def test_preemption_picks_lowest_priority_latest_admitted_and_recomputes_everything():
    s = scheduler(blocks=6, block_size=2, budget=100)
    first, second = seq(3, max_tokens=8), seq(3, max_tokens=8)
    s.submit(first)
    s.submit(second)
    plan = run_until_preemption(s)
    assert s.preemptions == 1 and second.status is SeqStatus.WAITING and second.num_computed == 0
    assert [q for q, _ in plan.entries] == [first]
    generated = second.num_output
    assert second.block_table == [] and generated >= 2  # what it generated is kept for the recompute
    s.finish(first, "length")
    plan = step(s)
    assert plan.entries == [(second, 3 + generated)]  # prompt + every generated token, in one chunk
    assert second.num_output == generated + 1  # and it goes on where it stopped


def test_low_priority_is_preempted_before_an_earlier_admitted_high_priority():
    s = scheduler(blocks=6, block_size=2, budget=100)
    low, high = seq(3, max_tokens=8, priority=2), seq(3, max_tokens=8, priority=1)
    s.submit(low)
    step(s)  # low is admitted first
    s.submit(high)
    run_until_preemption(s)
    assert low.status is SeqStatus.WAITING and high.status is SeqStatus.RUNNING


def test_preemption_step_admits_nothing_new():
    s = scheduler(blocks=6, block_size=2, budget=100)
    a, b = seq(3, max_tokens=8, priority=2), seq(3, max_tokens=8, priority=2)
    s.submit(a)
    s.submit(b)
    while s.pool.num_free:
        step(s)
    late = seq(1, max_tokens=1, priority=1)  # heads the waiting queue, fits once b's blocks are freed
    s.submit(late)
    run_until_preemption(s)
    assert late.status is SeqStatus.WAITING  # not in the step that preempted
    assert late in [q for q, _ in step(s).entries]  # but in the next one


def test_finish_and_cancel_return_every_block():
    s = scheduler(blocks=16, block_size=2)
    seqs = [seq(5, max_tokens=5) for _ in range(4)]
    for q in seqs:
        s.submit(q)
    step(s)
    step(s)
    assert s.pool.num_free < 16
    seqs[0].cancelled = True
    seqs[3].cancelled = True
    dropped = s.drop_cancelled()
    assert set(dropped) == {seqs[0], seqs[3]} and all(q.finish_reason == "cancelled" for q in dropped)
    s.finish(seqs[1], "eos")
    s.finish(seqs[2], "stop")
    assert s.pool.num_free == 16 and not s.running
    s.pool.check()


def test_expired_waiting_sequences_leave_with_deadline():
    s = scheduler(max_seqs=1)
    a, b = seq(4), seq(4)
    b.deadline_ns = 100
    s.submit(a)
    s.submit(b)
    step(s)
    assert s.expire(now_ns=50) == []
    assert s.expire(now_ns=100) == [b] and b.finish_reason == "deadline" and s.num_waiting == 0


def test_refusals_are_immediate():
    s = scheduler(blocks=4, block_size=4, max_len=64, max_waiting=1)
    with pytest.raises(InvalidInputError, match="max_model_len"):
        s.submit(seq(64))
    with pytest.raises(InvalidInputError, match="KV blocks"):
        s.submit(seq(10, max_tokens=20))
    s.submit(seq(4))
    with pytest.raises(QueueFullError):
        s.submit(seq(4))


def test_fragmentation_counts_unfilled_slots_of_allocated_blocks():
    pool = KVBlockPool(8, 4)
    q = seq(5)
    pool.allocate(q, 5)
    q.num_computed = 5
    assert len(q.block_table) == 2 and pool.fragmentation([q]) == pytest.approx(3 / 8)
    pool.free(q)
    assert pool.num_free == 8 and pool.fragmentation([q]) == 0.0


def test_a_request_needing_the_whole_pool_is_admitted_once_nothing_runs():
    s = scheduler(blocks=8, block_size=4, budget=200, margin=1)
    big, small = seq(30, max_tokens=2), seq(3, max_tokens=2)  # big needs all 8 blocks: more than 8 - margin
    s.submit(big)
    s.submit(small)
    plan = step(s)
    assert [q for q, _ in plan.entries] == [big]  # the margin does not apply to an empty batch


@pytest.mark.parametrize("token, sampling, reason", [
    (1, SamplingParams(max_tokens=8), "eos"),
    (7, SamplingParams(max_tokens=8, stop_token_ids=(7,)), "stop"),
    (7, SamplingParams(max_tokens=2), "length"),
    (1, SamplingParams(max_tokens=2, ignore_eos=True), "length"),
])
def test_postprocess_finishes_on_tokens_and_frees_blocks(token, sampling, reason):
    settings = ContinuousSettings(8, 32, 256, 100, 0, eos_token_ids=frozenset({1}))
    s = ContinuousScheduler(settings, KVBlockPool(64, 4))
    q = Sequence(next(_ids), [5, 6, 7], 3, sampling)
    s.submit(q)
    finished = []
    for _ in range(3):
        plan = s.schedule()
        finished += s.postprocess(plan, {q.seq_id: token})
        s.pool.check()
    assert finished == [q] and q.finish_reason == reason and q.status is SeqStatus.FINISHED
    assert q not in s.running and s.pool.num_free == 64  # its blocks are back


def test_postprocess_finishes_at_max_model_len():
    s = scheduler(max_len=5)
    q = seq(3, max_tokens=100)
    s.submit(q)
    finished = []
    while not finished:
        plan = s.schedule()
        finished = s.postprocess(plan, {q.seq_id: 7})
    assert q.num_tokens == 5 and q.finish_reason == "length" and s.pool.num_used == 0


# ------------------------------------------------------------ sliding windows: blocks behind the window
def windowed(blocks=64, block_size=4, window=8, budget=32, prefix_caching=False, max_len=1024):
    settings = ContinuousSettings(8, budget, max_len, 100, 0)
    return ContinuousScheduler(settings, KVBlockPool(blocks, block_size, prefix_caching, window=window))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_blocks_behind_the_window_are_given_back_as_a_sequence_decodes(prefix_caching):
    """A 200-token sequence on a window of 8 never holds more than the blocks its window and one step span;
    every given-back entry lies wholly behind the window, and every block is counted once (pool.check)."""
    s = windowed(prefix_caching=prefix_caching)
    q = seq(40, max_tokens=160)
    s.submit(q)
    most = 0
    while q.status is not SeqStatus.FINISHED:
        step(s)
        s.pool.check(s.running)
        live = sum(1 for b in q.block_table if b != RELEASED)
        most = max(most, live)
        if q.status is SeqStatus.RUNNING and q.num_computed >= 40:  # decoding: window + the next token
            assert live <= s.pool.blocks_for(8) + 1
    assert most <= s.pool.peak_blocks(200, 32)
    assert s.pool.num_used == 0  # the rest given back at the end (named ones parked, counted as free)


def test_a_sequence_longer_than_the_pool_is_admitted_only_where_blocks_are_given_back():
    long = dict(prompt_len=20, max_tokens=200)  # 220 tokens: 55 blocks of 4, on a pool of 16
    with pytest.raises(InvalidInputError, match="KV blocks"):
        scheduler(blocks=16).submit(seq(**long))
    s = windowed(blocks=16)
    q = seq(**long)
    s.submit(q)
    for _ in range(400):
        if q.status is SeqStatus.FINISHED:
            break
        step(s)
    assert q.finish_reason == "length" and q.num_output == 200 and s.preemptions == 0


def test_a_prefix_given_back_behind_the_window_is_still_found_by_the_next_prompt():
    s = windowed(prefix_caching=True, budget=64)
    first = seq(40, max_tokens=2)
    s.submit(first)
    step(s)  # the whole prompt in one step
    assert first.block_table[:8] == [RELEASED] * 8  # behind the window once the prompt is computed
    second = seq(40, max_tokens=2)  # the same 40 prompt tokens
    assert len(s.pool.match(second)) == 9  # every full block but the one holding the last token


def test_preemption_with_given_back_blocks_recomputes_and_counts_right():
    s = windowed(blocks=10, budget=16)
    seqs = [seq(4, max_tokens=40) for _ in range(6)]  # admitted on one block each, then each grows to 3-4
    for q in seqs:
        s.submit(q)
    for _ in range(400):
        if all(q.status is SeqStatus.FINISHED for q in seqs):
            break
        step(s)
        s.pool.check(s.running)
    assert s.preemptions >= 1
    assert all(q.num_output == 40 for q in seqs) and s.pool.num_used == 0


def test_a_long_cached_prompt_resumes_with_a_windows_worth_of_blocks():
    """A 40-token prompt's blocks are named, given back and parked. The same prompt again hits 9 of them
    but references only those inside the window of its first query, so the rest stay free for others."""
    s = windowed(blocks=12, prefix_caching=True, budget=64)
    first = seq(40, max_tokens=2)
    s.submit(first)
    while first.status is not SeqStatus.FINISHED:
        step(s)
    again = seq(40, max_tokens=8)
    assert len(s.pool.match(again)) == 9
    s.submit(again)
    plan = s.schedule()  # admission
    assert [(q.seq_id, n) for q, n in plan.entries] == [(again.seq_id, 4)]  # 36 cached, the last 4 computed
    assert again.block_table[:7] == [RELEASED] * 7  # never referenced: behind the window of position 36
    assert s.pool.num_used == 3  # hit blocks 7-8 and a new one (reviving all 9 hits would have taken 10)
    assert s.pool.cache.stats.hit_tokens == 36
    s.postprocess(plan, {again.seq_id: 7})
    while again.status is not SeqStatus.FINISHED:
        step(s)
        s.pool.check(s.running)
    assert again.num_output == 8 and s.pool.num_used == 0
