"""Paged attention over a flattened step: every scheduled token of every sequence in one tensor.

K/V live in one cache per layer, shaped [num_slots, kv_heads, head_dim] with slot = block * block_size
+ offset. A step writes its new K/V at `slot_mapping`, then each query attends over its sequence's
slots. Sequences are attended in two padded groups, decodes (one query each) and prompt chunks, so
one long prompt never pads hundreds of decodes to its length; within a group it is one batched
scaled_dot_product_attention call, no Python loop over sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionGroup:
    token_index: torch.Tensor  # [S, Q] positions in the flattened step (padding repeats a valid index)
    query_valid: torch.Tensor  # [S, Q] bool
    context_slots: torch.Tensor  # [S, C] cache slots of each sequence's context (padding: slot 0)
    mask: torch.Tensor  # [S, 1, Q, C] bool: key is in the context and not after the query


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    groups: list[AttentionGroup]


def build_group(starts: list[int], lengths: list[int], computed: list[int], tables: list[list[int]],
                block_size: int, device) -> AttentionGroup:
    """Gather indices and mask for sequences whose queries are tokens [start, start + length) of the step,
    at positions computed .. computed + length - 1 of their own sequence."""
    num, q_max = len(starts), max(lengths)
    ctx_lens = [c + n for c, n in zip(computed, lengths)]
    c_max = max(ctx_lens)
    q_off = torch.arange(q_max)
    token_index = torch.tensor(starts).unsqueeze(1) + q_off  # [S, Q]
    query_valid = q_off.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
    token_index = torch.where(query_valid, token_index, torch.tensor(starts).unsqueeze(1))
    blocks_max = -(-c_max // block_size)
    table = torch.zeros(num, blocks_max, dtype=torch.long)
    for i, blocks in enumerate(tables):
        used = blocks[:blocks_max]
        table[i, : len(used)] = torch.tensor(used, dtype=torch.long)
    c_off = torch.arange(c_max)
    slots = table[:, c_off // block_size] * block_size + c_off % block_size  # [S, C]
    ctx = torch.tensor(ctx_lens).unsqueeze(1)
    key_valid = c_off.unsqueeze(0) < ctx  # [S, C]
    query_pos = torch.tensor(computed).unsqueeze(1) + q_off  # [S, Q]
    causal = c_off.view(1, 1, -1) <= query_pos.unsqueeze(2)  # [S, Q, C]
    mask = causal & key_valid.unsqueeze(1)
    mask[:, :, 0] |= ~query_valid  # padded queries attend to one key rather than to none (NaN)
    slots = torch.where(key_valid, slots, torch.zeros_like(slots))
    return AttentionGroup(token_index.to(device), query_valid.to(device), slots.to(device), mask.unsqueeze(1).to(device))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    # q: [T, H, D]; caches: [slots, KVH, D]
    out = torch.empty_like(q)
    for group in meta.groups:
        qg = q[group.token_index].transpose(1, 2)  # [S, H, Q, D]
        kg = k_cache[group.context_slots].transpose(1, 2)  # [S, KVH, C, D]
        vg = v_cache[group.context_slots].transpose(1, 2)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=group.mask, enable_gqa=True)  # [S, H, Q, D]
        og = og.transpose(1, 2)  # [S, Q, H, D]
        out[group.token_index[group.query_valid]] = og[group.query_valid]
    return out
