"""LoRA in the pure policies: at most max_loras adapters run at once, and prefix chains never cross adapters."""

from __future__ import annotations

from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence

_ids = iter(range(10**6))


def seq(lora_key: bytes = b"", prompt: list[int] | None = None, max_tokens: int = 2) -> Sequence:
    tokens = prompt or list(range(1, 10))
    return Sequence(next(_ids), list(tokens), len(tokens), SamplingParams(max_tokens=max_tokens), lora_key=lora_key)


def step(s: ContinuousScheduler):
    plan = s.schedule()
    s.postprocess(plan, {q.seq_id: 7 for q, n in plan.entries if q.num_computed + n == q.num_tokens})
    s.pool.check(s.running)
    return plan


def test_an_adapter_past_max_loras_waits_without_blocking_those_behind_it():
    s = ContinuousScheduler(ContinuousSettings(max_num_seqs=8, max_num_batched_tokens=64, max_loras=1),
                            KVBlockPool(64, 4))
    a1, b, a2, base = seq(b"A"), seq(b"B"), seq(b"A"), seq()
    for q in (a1, b, a2, base):
        s.submit(q)
    first = {q.seq_id for q, _ in step(s).entries}
    assert first == {a1.seq_id, a2.seq_id, base.seq_id}  # B passed over; A's second request and the base went by
    assert s.waiting() == [b]  # B kept its place
    while s.running:
        assert b not in s.running
        step(s)
    assert {q.seq_id for q, _ in step(s).entries} == {b.seq_id}  # A's slot freed: B runs


def test_prefix_blocks_are_shared_within_an_adapter_only():
    pool = KVBlockPool(32, 4, prefix_caching=True)
    prompt = list(range(1, 14))  # three full blocks a later request can find
    first = seq(b"A", prompt)
    pool.admit(first, len(prompt), pool.match(first))
    first.num_computed = len(prompt)
    pool.cache_full_blocks(first)
    assert pool.match(seq(b"B", prompt)) == [] and pool.match(seq(b"", prompt)) == []
    assert pool.match(seq(b"A", prompt)) == first.block_table[:3]
