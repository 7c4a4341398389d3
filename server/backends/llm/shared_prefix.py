"""Shared-prefix (cascade) attention: many sequences that start with the same cached blocks read them once.

With prefix caching, 200 requests behind one 1,000-token system prompt hold the same physical KV blocks
for it. Gather + SDPA (attention.py) would still copy those 1,000 keys out of the cache once per
sequence per layer per step, 200x the same rows, and that copy was most of a decode step on such a
load. Here a step's sequences are clustered by the blocks they share; each cluster's prefix keys are
gathered once and every query of the cluster attends to them in one matmul, while attention.py
attends each sequence only to its own keys after the prefix. The two partial softmaxes are joined
exactly by their log-sum-exps (the identity FlashInfer's cascade attention and vLLM's use):

    out = out_prefix * exp(lse_prefix - lse) + out_rest * exp(lse_rest - lse),  lse = logaddexp(both)

A cluster is only formed when it saves real work (`MIN_SAVED` key rows a layer) and only from keys every
query of the cluster may see: whole blocks, all before each sequence's first query of the step. The
softmax is computed in float32 whatever the model dtype, as SDPA accumulates it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

MIN_SAVED = 1024  # key rows a layer the cluster must save (its members' prefix copies but one) to be worth a call


@dataclass(frozen=True, slots=True)
class Cluster:
    """Sequences of one step that hold the same leading blocks: what `find` decides."""

    rows: list[int]  # the step rows (queries) of every member
    blocks: list[int]  # the shared blocks, in order
    members: int
    tokens: int  # keys in the shared blocks

    @property
    def saved(self) -> int:
        """Key reads a layer saves: every member but one would have gathered the prefix itself."""
        return self.tokens * (self.members - 1)


@dataclass(slots=True)
class SharedPrefix:
    rows: torch.Tensor  # [N] the step rows (queries) of every member of the cluster
    slots: torch.Tensor  # [L] cache slots of the shared prefix's keys, in position order


def find(entries: list[tuple[int, int, int, list[int]]], block_size: int) -> tuple[list[Cluster], dict[int, int]]:
    """Clusters of entries (start, length, computed, block table) sharing leading blocks, and for every
    member its start -> the prefix length it need not gather itself."""
    by_first: dict[int, list] = defaultdict(list)
    for entry in entries:
        if entry[2] >= block_size and entry[3]:  # at least one whole block before its first query
            by_first[entry[3][0]].append(entry)
    clusters, skip = [], {}
    for members in by_first.values():
        if len(members) < 2:
            continue
        blocks = min(e[2] // block_size for e in members)  # whole blocks before every member's first query
        table = members[0][3]
        for _, _, _, other in members[1:]:
            if other[:blocks] != table[:blocks]:  # compared in C; the first difference found only when there is one
                blocks = next(i for i, (a, b) in enumerate(zip(table[:blocks], other)) if a != b)
        rows = [row for start, length, _, _ in members for row in range(start, start + length)]
        cluster = Cluster(rows, table[:blocks], len(members), blocks * block_size)
        if cluster.saved < MIN_SAVED:
            continue
        clusters.append(cluster)
        skip.update((start, cluster.tokens) for start, *_ in members)
    return clusters, skip


def build(clusters: list[Cluster], block_size: int, device) -> list[SharedPrefix]:
    out = []
    for cluster in clusters:
        slots = torch.tensor(cluster.blocks, dtype=torch.long).unsqueeze(1) * block_size + torch.arange(block_size)
        out.append(SharedPrefix(torch.tensor(cluster.rows, dtype=torch.long, device=device), slots.flatten().to(device)))
    return out


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention that also returns the log-sum-exp. q: [B, KVH, G * Q, D] (the G query heads of
    each key head as extra query rows), k, v: [B, KVH, C, D], bias: [B, 1, G * Q, C] or None. Returns
    the output [B, KVH, G * Q, D] in q's dtype and the lse [B, KVH, G * Q] in float32."""
    if q.device.type == "cpu" and _flash_runs():
        return _FLASH(q, k, v, 0.0, False, attn_mask=bias)
    return _attend_plain(q, k, v, bias)


def _attend_plain(q, k, v, bias):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(q.shape[-1] ** -0.5)  # [B, KVH, G * Q, C]
    if bias is not None:
        scores.add_(bias)
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs, v.float()).to(q.dtype), lse


# PyTorch's fused CPU flash kernel returns the lse beside the output and reads strided K/V without a
# copy: 2x the plain matmuls here. It is a private op (the one SDPA dispatches to on a CPU), so it is
# checked once against the plain path and skipped if it is missing or disagrees.
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_ok: bool | None = None


def _flash_runs() -> bool:
    global _flash_ok
    if _flash_ok is None:
        _flash_ok = False
        if _FLASH is not None:
            try:
                gen = torch.Generator().manual_seed(0)
                q, k, v = (torch.randn(2, 2, 3, 8, generator=gen) for _ in range(3))
                bias = torch.zeros(2, 1, 3, 3).masked_fill_(torch.ones(3, 3, dtype=torch.bool).triu(1), float("-inf"))
                out, lse = _FLASH(q, k, v, 0.0, False, attn_mask=bias)
                ref_out, ref_lse = _attend_plain(q, k, v, bias)
                _flash_ok = bool(torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5))
            except (RuntimeError, TypeError):
                pass
    return _flash_ok


def attend_prefix(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  prefix: SharedPrefix) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query of the cluster against the prefix keys (all visible): ([N, H, D], lse [N, H])."""
    n, heads, dim = len(prefix.rows), q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    qp = q.index_select(0, prefix.rows).view(n, kv_heads, group, dim).permute(1, 2, 0, 3)  # [KVH, G, N, D]
    kp = k_cache.index_select(0, prefix.slots).transpose(0, 1)  # [KVH, L, D]
    vp = v_cache.index_select(0, prefix.slots).transpose(0, 1)
    out, lse = attend(qp.reshape(1, kv_heads, group * n, dim), kp.unsqueeze(0), vp.unsqueeze(0))
    out = out.reshape(kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, heads, dim)
    return out, lse.reshape(kv_heads, group, n).permute(2, 0, 1).reshape(n, heads)


def merge(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          prefixes: list[SharedPrefix]) -> None:
    """Fold each cluster's prefix attention into `out` ([T, H, D], its rows attended over the rest only,
    with their lse [T, H]), in place."""
    for prefix in prefixes:
        o1, lse1 = attend_prefix(q, k_cache, v_cache, prefix)
        o2, lse2 = out.index_select(0, prefix.rows).float(), lse.index_select(0, prefix.rows)
        total = torch.logaddexp(lse1, lse2)
        joined = o1.float() * (lse1 - total).exp_().unsqueeze(-1) + o2 * (lse2 - total).exp_().unsqueeze(-1)
        out.index_copy_(0, prefix.rows, joined.to(out.dtype))
