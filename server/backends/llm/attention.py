"""Paged attention over a flattened step: every scheduled token of every sequence in one tensor.

K/V live in one cache per layer, shaped [num_slots, kv_heads, head_dim] with slot = block * block_size
+ offset. A step writes its new K/V at `slot_mapping`, then each query attends over its sequence's
slots. Sequences are attended in two padded groups, decodes (one query each) and prompt chunks, so
one long prompt never pads hundreds of decodes to its length; within a group it is one batched
scaled_dot_product_attention call, no Python loop over sequences. (On a CPU where cpu_decode.py's
kernel builds, decodes skip the groups and read the cache in place: `StepMetadata.decodes`.)

Sliding-window layers (Mistral, Qwen2/Qwen3 with `use_sliding_window`) let the query at position p
see only keys p - window < k <= p, as transformers does. The window is a second mask over the same
gathered keys; when every layer slides, only the keys some query of the step can still see are
gathered, so a decode reads at most `window` keys however long the sequence has grown.

A group is padded to its longest query run and longest context, so sequences of very different
lengths are split into several groups (`split_by_length`): 34 short chats beside 14 long documents
would otherwise gather and score 3-8x the keys they have.

NOTE: everything indexed per layer goes through `index_select`/`index_copy_` on dim 0 of flat index
tensors built once per step: advanced indexing (`cache[slots]` with a 2-D index, `out[mask] = ...`)
runs an element-wise kernel 10-20x slower than index_select's row copies on a CPU, and it was a third
of a decode step (docs/architecture.md, "Generation step cost"). The masks go to SDPA as additive
float biases made once per step: SDPA turns a bool mask into the same bias on every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from server.backends.llm import shared_prefix
from server.backends.llm.paged_kernel import VarlenStep
from server.backends.llm.shared_prefix import SharedPrefix

if TYPE_CHECKING:  # cpu_decode builds its steps' block tables with block_tables() below
    from server.backends.llm.cpu_decode import DecodeStep


@dataclass(slots=True)
class AttentionGroup:
    token_index: torch.Tensor  # [S, Q] positions in the flattened step (padding repeats a valid index)
    query_valid: torch.Tensor  # [S, Q] bool
    context_slots: torch.Tensor  # [S, C] cache slots of the keys gathered for each sequence (padding: slot 0)
    mask: torch.Tensor | None  # [S, 1, Q, C] bool: key gathered and not after the query; None if every layer slides
    window_mask: torch.Tensor | None  # the same, also within the sliding window; None if no layer slides
    flat_index: torch.Tensor  # [S * Q] token_index flattened, for index_select
    flat_slots: torch.Tensor  # [S * C] context_slots flattened
    flat_blocks: torch.Tensor | None  # [S * C / block_size] the same keys as whole cache blocks, when they are (_keys)
    block_size: int
    rows: torch.Tensor  # [valid queries] the step rows the group's outputs go to
    pick: torch.Tensor | None  # [valid queries] their places in the flattened [S * Q] output; None: all valid
    bias: torch.Tensor | None  # `mask` as SDPA's additive float mask (0 or -inf), in the model's dtype
    window_bias: torch.Tensor | None

    def mask_for(self, sliding: bool) -> torch.Tensor:
        return self.window_mask if sliding else self.mask

    def bias_for(self, sliding: bool) -> torch.Tensor:
        return self.window_bias if sliding else self.bias


@dataclass(slots=True)
class StepMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    groups: list[AttentionGroup]
    varlen: VarlenStep | None = None  # set: the paged flash kernel reads the cache instead (paged_kernel.py)
    prefixes: list[SharedPrefix] = field(default_factory=list)  # blocks many sequences share (shared_prefix.py)
    decodes: DecodeStep | None = None  # set: the decodes are read in place by the CPU kernel (cpu_decode.py), not grouped
    lora: Any = None  # set: some rows use a LoRA adapter (lora.LoraStep)


PADDING = 1.25  # a group's padded query-key pairs may be this many times its real ones ...
MIN_WASTE = 256  # ... or waste this few pairs: below it one more SDPA call costs more than it saves
MAX_GROUP_KEYS = 8192  # and gathers at most this many keys (sequences x padded context): see split_by_length
# (Measured 2026-12-01 with oneDNN Linear layers: 1.25 / 256 against 2.0 / 4096 cut a burst's decode
# groups' padding from 1.86x to 1.25x their real keys and cost 1.17x less CPU a token; docs/architecture.md.)


def split_by_length(entries: list[tuple[int, int, int, list[int]]],
                    skip: dict[int, int] | None = None) -> list[list[tuple[int, int, int, list[int]]]]:
    """Entries (start, length, computed, block table) into groups whose padding stays bounded: longest
    first, a new group when adding the next would pad the group past PADDING times its real work.
    `skip`: start -> leading keys an entry does not gather (a shared prefix attended apart)."""
    skip = skip or {}
    groups: list[list] = []
    q_max = c_max = real = 0
    for entry in sorted(entries, key=lambda e: e[1] * (e[1] + e[2] - skip.get(e[0], 0)), reverse=True):
        q, c = entry[1], entry[1] + entry[2] - skip.get(entry[0], 0)
        padded = (len(groups[-1]) + 1) * max(q_max, q) * max(c_max, c) if groups else 0
        too_wide = groups and (len(groups[-1]) + 1) * max(c_max, c) > MAX_GROUP_KEYS
        if not groups or too_wide or (padded > PADDING * (real + q * c) and padded - real - q * c > MIN_WASTE):
            groups.append([])
            q_max = c_max = real = 0
        groups[-1].append(entry)
        q_max, c_max, real = max(q_max, q), max(c_max, c), real + q * c
    return groups


def block_tables(tables: list[list[int]], width: int) -> np.ndarray:
    """[S, width] int64: each block table cut or padded to `width`, blocks given back behind a window (-1)
    as 0, never read. One array from padded lists: a tensor or an array copy per sequence cost 10x more."""
    padding = [0] * width
    table = np.array([(list(blocks[:width]) + padding)[:width] for blocks in tables], dtype=np.int64)
    np.maximum(table, 0, out=table)
    return table


def build_group(starts: list[int], lengths: list[int], computed: list[int], tables: list[list[int]],
                block_size: int, device, window: int | None = None, full: bool = True,
                dtype: torch.dtype = torch.float32, skip: list[int] | None = None) -> AttentionGroup:
    """Gather indices and masks for sequences whose queries are tokens [start, start + length) of the step,
    at positions computed .. computed + length - 1 of their own sequence. `window`: the sliding window of
    the layers that slide (None: none does); `full`: some layer attends to the whole context; `skip`:
    each sequence's leading keys attended apart as a shared prefix (no layer slides then).

    Built with numpy and handed to torch without a copy: these are a few dozen operations on small
    arrays per group, once per step, and numpy's cost a call is a fraction of torch's (a step of 256
    decodes in 8 groups: 2.6 ms of setup with torch, a tensor per block table; 1.0 ms here)."""
    start = np.asarray(starts, dtype=np.int64)[:, None]  # [S, 1]
    length = np.asarray(lengths, dtype=np.int64)[:, None]
    done = np.asarray(computed, dtype=np.int64)[:, None]
    ctx_len = done + length
    # The first key any query of the step can see: the sequence's first, unless every layer slides.
    if skip:
        first = np.asarray(skip, dtype=np.int64)[:, None]
    elif full or window is None:
        first = np.zeros_like(done)
    else:
        first = np.maximum(done - window + 1, 0)
    q_max, c_max = int(length.max()), int((ctx_len - first).max())
    # Keys from a block boundary on (no layer slides) are gathered as whole blocks: one row of block_size
    # slots per index rather than one slot, a third less time per gather at 256 decodes x ~200 keys
    # (the few keys past each sequence's end are masked like any padding).
    aligned = not (first % block_size).any()
    if aligned:
        c_max = -(-c_max // block_size) * block_size
    q_off = np.arange(q_max)
    query_valid = q_off < length  # [S, Q]
    token_index = np.where(query_valid, start + q_off, start)
    blocks_max = -(-int(ctx_len.max()) // block_size)
    table = block_tables(tables, blocks_max)  # (blocks given back behind a window: no key there is gathered, see `first`)
    key_pos = first + np.arange(c_max)  # [S, C] positions of the gathered keys
    key_valid = key_pos < ctx_len
    key_pos = np.where(key_valid, key_pos, 0)
    slots = np.take_along_axis(table, key_pos // block_size, 1) * block_size + key_pos % block_size
    slots = np.where(key_valid, slots, 0)
    flat_blocks = None
    if aligned:
        columns = np.minimum(first // block_size + np.arange(c_max // block_size), blocks_max - 1)
        flat_blocks = torch.from_numpy(np.take_along_axis(table, columns, 1).ravel()).to(device)
    query_pos = (done + q_off)[:, :, None]  # [S, Q, 1]
    causal = (key_pos[:, None, :] <= query_pos) & key_valid[:, None, :]  # [S, Q, C]
    window_mask = causal & (key_pos[:, None, :] > query_pos - window) if window is not None else None
    mask = causal if full else None

    def finish(m: np.ndarray | None) -> torch.Tensor | None:
        if m is None:
            return None
        m[:, :, 0] |= ~query_valid  # padded queries attend to one key rather than to none (NaN)
        return torch.from_numpy(m[:, None]).to(device)

    def bias(m: torch.Tensor | None) -> torch.Tensor | None:
        return None if m is None else torch.zeros(m.shape, dtype=dtype, device=device).masked_fill_(~m, float("-inf"))

    mask, window_mask = finish(mask), finish(window_mask)
    valid = query_valid.ravel()
    pick = None if valid.all() else torch.from_numpy(np.flatnonzero(valid)).to(device)
    token_index = torch.from_numpy(token_index).to(device)
    flat = token_index.flatten()
    slots = torch.from_numpy(slots).to(device)
    return AttentionGroup(token_index, torch.from_numpy(query_valid).to(device), slots, mask, window_mask, flat,
                          slots.flatten(), flat_blocks, block_size, flat if pick is None else flat.index_select(0, pick),
                          pick, bias(mask), bias(window_mask))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata,
                    sliding: bool = False) -> torch.Tensor:
    # q: [T, H, D]; caches: [slots, KVH, D]
    if meta.prefixes:
        return _cascade(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    _, heads, dim = q.shape
    if meta.decodes is not None:
        meta.decodes.attend(q, k_cache, v_cache, sliding, out)
    for group in meta.groups:
        num, q_len = group.token_index.shape
        qg = q.index_select(0, group.flat_index).view(num, q_len, heads, dim).transpose(1, 2)  # [S, H, Q, D]
        kg, vg = _keys(k_cache, group), _keys(v_cache, group)
        og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=group.bias_for(sliding), enable_gqa=True)
        og = og.transpose(1, 2).reshape(num * q_len, heads, dim)  # [S * Q, H, D]
        out.index_copy_(0, group.rows, og if group.pick is None else og.index_select(0, group.pick))
    return out


def _keys(cache: torch.Tensor, group: AttentionGroup) -> torch.Tensor:
    """The group's gathered keys (or values) of one layer: [S, KVH, C, D]."""
    num, c_len = group.context_slots.shape
    if group.flat_blocks is not None:
        blocks = cache.view(-1, group.block_size, *cache.shape[1:])
        return blocks.index_select(0, group.flat_blocks).view(num, c_len, *cache.shape[1:]).transpose(1, 2)
    return cache.index_select(0, group.flat_slots).view(num, c_len, *cache.shape[1:]).transpose(1, 2)


def _cascade(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    """The groups over the keys after each shared prefix, with their log-sum-exps, then each prefix
    folded in (shared_prefix.py). Only for models where no layer slides."""
    out = torch.empty_like(q)
    t, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    lse = torch.zeros(t, heads, dtype=torch.float32, device=q.device)
    for group in meta.groups:
        num, q_len = group.token_index.shape
        c_len = group.context_slots.shape[1]
        qg = q.index_select(0, group.flat_index).view(num, q_len, kv_heads, heads // kv_heads, dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(num, kv_heads, heads // kv_heads * q_len, dim)  # head-major
        kg, vg = _keys(k_cache, group), _keys(v_cache, group)
        bias = group.bias.unsqueeze(2).expand(num, 1, heads // kv_heads, q_len, c_len)  # each head's rows alike
        og, lg = shared_prefix.attend(qg, kg, vg, bias.reshape(num, 1, heads // kv_heads * q_len, c_len))
        og = og.reshape(num, heads, q_len, dim).transpose(1, 2).reshape(num * q_len, heads, dim)
        lg = lg.reshape(num, heads, q_len).transpose(1, 2).reshape(num * q_len, heads)
        if group.pick is not None:
            og, lg = og.index_select(0, group.pick), lg.index_select(0, group.pick)
        out.index_copy_(0, group.rows, og)
        lse.index_copy_(0, group.rows, lg)
    shared_prefix.merge(out, lse, q, k_cache, v_cache, meta.prefixes)
    return out
