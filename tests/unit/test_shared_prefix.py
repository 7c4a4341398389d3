"""Shared-prefix (cascade) attention (shared_prefix.py): sequences holding the same leading KV blocks
read them once, and every query still gets what attending over its own sequence alone gives."""

import pytest
import torch

from server.backends.llm import shared_prefix
from server.backends.llm.attention import StepMetadata, build_group, paged_attention, split_by_length

BLOCK, KV_HEADS, HEADS, DIM = 4, 2, 6, 8


def reference(q, k_cache, v_cache, start, n, c, table):
    pos = torch.arange(n + c)
    slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
    k = k_cache[slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)  # [H, C, D]
    v = v_cache[slots].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    causal = pos.unsqueeze(0) <= (c + torch.arange(n)).unsqueeze(1)
    out = torch.nn.functional.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k, v, attn_mask=causal)
    return out.transpose(0, 1)


def step(lengths, computed, tables):
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, n, c, t) for s, n, c, t in zip(starts, lengths, computed, tables)]


NO_FUSED = pytest.mark.skipif(not shared_prefix._flash_runs(),
                              reason="this PyTorch has no fused CPU flash kernel returning the lse")


@pytest.mark.parametrize("fused", [pytest.param(True, id="fused-kernel", marks=NO_FUSED),
                                   pytest.param(False, id="plain-matmuls")])
def test_sequences_sharing_blocks_attend_the_prefix_once_and_match_attending_alone(fused, monkeypatch):
    monkeypatch.setattr(shared_prefix, "_flash_ok", fused)
    torch.manual_seed(0)
    total_blocks = 512
    k_cache, v_cache = torch.randn(total_blocks * BLOCK, KV_HEADS, DIM), torch.randn(total_blocks * BLOCK, KV_HEADS, DIM)
    free = list(range(1, total_blocks))
    shared = [free.pop() for _ in range(80)]  # a 320-token system prompt, cached once
    lengths = [1] * 6 + [7, 1, 3]  # decodes, a prompt chunk after the cached prefix, two unrelated sequences
    computed = [330, 345, 400, 322, 360, 333, 320, 40, 9]
    tables = []
    for i, (n, c) in enumerate(zip(lengths, computed)):
        own = [free.pop() for _ in range(-(-(n + c) // BLOCK) - len(shared))] if i < 7 else []
        tables.append(shared + own if i < 7 else [free.pop() for _ in range(-(-(n + c) // BLOCK))])
    given = step(lengths, computed, tables)
    clusters, skip = shared_prefix.find(given, BLOCK)
    assert len(clusters) == 1 and clusters[0].tokens == 320  # the whole shared run, all before every member's queries
    assert clusters[0].members == 7 and len(clusters[0].rows) == 13 and clusters[0].saved == 320 * 6
    assert sorted(skip) == [e[0] for e in given[:7]]
    meta = StepMetadata(torch.empty(0, dtype=torch.long), [], prefixes=shared_prefix.build(clusters, BLOCK, "cpu"))
    meta.groups = [build_group(*zip(*g), BLOCK, "cpu", skip=[skip.get(e[0], 0) for e in g])
                   for g in split_by_length(given, skip)]
    assert max(g.context_slots.shape[1] for g in meta.groups) < 100  # no member gathers the prefix itself
    q = torch.randn(sum(lengths), HEADS, DIM)
    out = paged_attention(q, k_cache, v_cache, meta)
    for entry in given:
        start, n = entry[0], entry[1]
        torch.testing.assert_close(out[start:start + n], reference(q, k_cache, v_cache, *entry), rtol=1e-5, atol=1e-5)


def test_no_cluster_where_it_saves_nothing_or_a_query_could_not_see_the_prefix():
    shared = list(range(10, 20))  # 40 tokens
    tiny = step([1, 1], [41, 45], [shared + [30], shared + [31, 32]])
    assert shared_prefix.find(tiny, BLOCK) == ([], {})  # 40 key rows saved: less than a call costs
    long_shared = list(range(100, 400))  # 1,200 tokens
    first_chunk = step([64, 1, 1], [0, 1201, 1300], [long_shared, long_shared + [1], long_shared + [2] * 26])
    clusters, skip = shared_prefix.find(first_chunk, BLOCK)
    assert len(clusters) == 1 and set(skip) == {64, 65}  # the chunk computing the prefix itself stays out
    diverging = step([1, 1, 1], [1300] * 3, [long_shared[:150] + [k] * 176 for k in (5, 6, 7)])
    assert shared_prefix.find(diverging, BLOCK)[0][0].tokens == 150 * BLOCK  # only the blocks all really hold
