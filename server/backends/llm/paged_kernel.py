"""Paged attention on CUDA with PyTorch's own flash kernel, reading the KV cache in place.

`torch.nn.attention.varlen.varlen_attn` (PyTorch >= 2.9, CUDA, fp16/bf16) takes the step's queries
packed sequence after sequence, the cache as a pool of pages [blocks, block_size, kv_heads, head_dim]
(Ferry's cache viewed so, no copy) and each sequence's block table: no gather, no padding, no mask
tensor; causality and the sliding window are the kernel's `window_size`, aligned bottom-right (the
last query sits at the last key), which is what a decode or a prompt chunk after cached tokens needs.
The step's tokens already are packed that way: each plan entry is one run of one sequence's tokens.

Whether the kernel runs here (a CUDA device, a half dtype, a block size and head size the build
accepts) is found once at load by `probe`, which runs it on a tiny cache; everywhere else the engine
uses attention.py's gather + SDPA (on a CPU, decodes read the cache in place through cpu_decode.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class VarlenStep:
    """What the kernel needs of one step, built once and shared by every layer."""

    cu_seq_q: torch.Tensor  # [N + 1] int32: where each sequence's queries start in the step
    cu_seq_k: torch.Tensor  # [N + 1] int32: the same over each sequence's whole context
    seqused_k: torch.Tensor  # [N] int32: keys each sequence has, this step's included
    block_table: torch.Tensor  # [N, max blocks] int32 (blocks given back behind a window: 0, never read)
    max_q: int
    max_k: int
    block_size: int


def build_step(lengths: list[int], computed: list[int], tables: list[list[int]], block_size: int, device) -> VarlenStep:
    ctx = [c + n for c, n in zip(computed, lengths)]
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, blocks in enumerate(tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    table.clamp_(min=0)

    def cumulative(values: list[int]) -> torch.Tensor:
        return torch.tensor([0, *values], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)

    return VarlenStep(cumulative(lengths), cumulative(ctx), torch.tensor(ctx, dtype=torch.int32, device=device),
                      table.to(device), max(lengths), max(ctx), block_size)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, step: VarlenStep,
           window: int | None) -> torch.Tensor:
    """q: [T, H, D] packed by sequence; caches: [slots, KVH, D]. `window`: this layer's sliding window."""
    from torch.nn.attention.varlen import varlen_attn

    pages = (k_cache.shape[0] // step.block_size, step.block_size, *k_cache.shape[1:])
    return varlen_attn(q, k_cache.view(pages), v_cache.view(pages), step.cu_seq_q, step.cu_seq_k, step.max_q,
                       step.max_k, window_size=(-1 if window is None else window - 1, 0), enable_gqa=True,
                       seqused_k=step.seqused_k, block_table=step.block_table)


def probe(device: torch.device, dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """True when the kernel runs on this device for this layout and agrees with SDPA on a small case."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        blocks = 4
        k = torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
        n, c = 3, block_size + 2  # a 3-token chunk after block_size + 2 cached tokens, in blocks 2 and 0
        q = torch.randn(n, heads, head_dim, generator=gen).to(device, dtype)
        out = attend(q, k, v, build_step([n], [c], [[2, 0]], block_size, device), None)
        pos = torch.arange(n + c)
        slots = torch.tensor([2, 0])[pos // block_size] * block_size + pos % block_size
        mask = (pos.unsqueeze(0) <= (c + torch.arange(n)).unsqueeze(1)).to(device)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k[slots.to(device)].transpose(0, 1), v[slots.to(device)].transpose(0, 1),
            attn_mask=mask, enable_gqa=True).transpose(0, 1)
        ok = bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2))
        if not ok:
            log.warning("PyTorch's paged flash attention disagrees with SDPA here; using gather + SDPA")
        return ok
    except (RuntimeError, ValueError, ImportError, NotImplementedError) as exc:
        log.info("PyTorch's paged flash attention does not run here (%s); using gather + SDPA", exc)
        return False
