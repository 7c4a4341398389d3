"""Paged attention's grouping (attention.py): sequences of unlike length go in separate padded groups,
and whatever the grouping, every query gets what attending over its own sequence alone gives."""

import torch

from server.backends.llm import paged_kernel
from server.backends.llm.attention import MAX_GROUP_KEYS, MIN_WASTE, PADDING, StepMetadata, build_group, paged_attention, split_by_length


def entries(lengths: list[int], computed: list[int]) -> list[tuple[int, int, int, list[int]]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(s, n, c, []) for s, n, c in zip(starts, lengths, computed)]


def test_every_entry_lands_in_exactly_one_group_and_padding_stays_bounded():
    given = entries([1] * 40 + [30, 200, 7], [20, 300] * 20 + [0, 0, 500])
    groups = split_by_length(given)
    assert sorted(e[0] for g in groups for e in g) == sorted(e[0] for e in given)
    assert len(groups) > 1  # 20 decodes at 21 keys beside 20 at 301 are not padded to 301
    for group in groups:
        q_max, c_max = max(e[1] for e in group), max(e[1] + e[2] for e in group)
        padded, real = len(group) * q_max * c_max, sum(e[1] * (e[1] + e[2]) for e in group)
        assert padded <= PADDING * real or len(group) == 1 or padded - real <= MIN_WASTE


def test_a_wide_step_is_gathered_in_groups_of_bounded_keys():
    """256 decodes at ~200 keys would gather 51,200 keys of K and V per layer in one group: tens of MiB a
    layer, from fresh pages every step; groups stay within MAX_GROUP_KEYS (sequences x padded context)."""
    given = entries([1] * 256, [190 + i % 20 for i in range(256)])
    groups = split_by_length(given)
    assert sorted(e[0] for g in groups for e in g) == sorted(e[0] for e in given)
    assert len(groups) >= 256 * 210 // MAX_GROUP_KEYS
    for group in groups:
        assert len(group) * max(e[1] + e[2] for e in group) <= MAX_GROUP_KEYS


def test_like_lengths_stay_in_one_group():
    assert len(split_by_length(entries([1] * 48, [100 + i for i in range(48)]))) == 1
    assert split_by_length([]) == []


def test_grouped_paged_attention_equals_each_sequence_attending_alone():
    torch.manual_seed(0)
    block, kv_heads, heads, dim = 4, 2, 4, 8
    lengths, computed = [1, 1, 1, 5, 17, 1], [3, 40, 9, 0, 6, 70]
    total_blocks = 64
    k_cache, v_cache = torch.randn(total_blocks * block, kv_heads, dim), torch.randn(total_blocks * block, kv_heads, dim)
    free = torch.randperm(total_blocks).tolist()
    tables = []
    for n, c in zip(lengths, computed):
        need = -(-(n + c) // block)
        tables.append([free.pop() for _ in range(need)])
    given = [(e[0], e[1], e[2], t) for e, t in zip(entries(lengths, computed), tables)]
    groups = [build_group(*zip(*g), block, "cpu") for g in split_by_length(given)]
    assert len(groups) > 1
    q = torch.randn(sum(lengths), heads, dim)
    out = paged_attention(q, k_cache, v_cache, StepMetadata(torch.empty(0, dtype=torch.long), groups))
    for start, n, c, table in given:
        pos = torch.arange(n + c)
        slots = torch.tensor(table)[pos // block] * block + pos % block
        k = k_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)  # [H, C, D]
        v = v_cache[slots].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
        causal = pos.unsqueeze(0) <= (c + torch.arange(n)).unsqueeze(1)  # [Q, C]
        ref = torch.nn.functional.scaled_dot_product_attention(q[start:start + n].transpose(0, 1), k, v, attn_mask=causal)
        torch.testing.assert_close(out[start:start + n], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_the_paged_kernel_step_packs_each_sequence_as_the_step_does():
    step = paged_kernel.build_step([1, 5, 1], [9, 0, 30], [[4, 7, -1], [2], [1, 3]], 4, "cpu")
    assert step.cu_seq_q.tolist() == [0, 1, 6, 7] and step.cu_seq_k.tolist() == [0, 10, 15, 46]
    assert step.seqused_k.tolist() == [10, 5, 31] and (step.max_q, step.max_k, step.block_size) == (5, 31, 4)
    assert step.block_table.tolist() == [[4, 7, 0], [2, 0, 0], [1, 3, 0]]  # a given-back block (-1) is never read
    assert step.block_table.dtype == torch.int32


def test_the_paged_kernel_is_only_chosen_where_it_runs():
    assert not paged_kernel.probe(torch.device("cpu"), torch.float32, 16, 4, 2, 8)
    assert not paged_kernel.probe(torch.device("cpu"), torch.bfloat16, 16, 4, 2, 8)
