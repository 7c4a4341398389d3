"""The CPU decode kernel (cpu_decode.py) against SDPA over the same keys gathered: GQA groups, head sizes
that are not a multiple of the vector width, contexts ending on and across block boundaries, sliding
windows (with the blocks behind them given back), and the switch that turns it off."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from server.backends.llm import cpu_decode

KERNEL = cpu_decode.load(torch.device("cpu"), torch.float32, 1, 1)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="no C compiler here: the engine keeps gather + SDPA")


def reference(q, k_cache, v_cache, tables, ctx, block_size, window=None):
    """Each sequence alone: its keys gathered in order, SDPA with GQA, the window as the first key kept."""
    out = []
    for i, (table, length) in enumerate(zip(tables, ctx)):
        slots = (torch.tensor(table).clamp(min=0)[:, None] * block_size + torch.arange(block_size)).ravel()[:length]
        first = max(0, length - window) if window else 0
        keys, values = k_cache[slots[first:]].transpose(0, 1), v_cache[slots[first:]].transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[i][None, :, None], keys[None], values[None], enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def pool(seed, contexts, block_size, kv_heads, dim, spare_blocks=7):
    """A cache with each sequence's blocks scattered at random, and their block tables."""
    rng = np.random.default_rng(seed)
    needed = [-(-c // block_size) for c in contexts]
    blocks = rng.permutation(sum(needed) + spare_blocks)
    tables, at = [], 0
    for n in needed:
        tables.append(blocks[at : at + n].tolist())
        at += n
    torch.manual_seed(seed)
    slots = len(blocks) * block_size
    return torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim), tables


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 4, 64), (4, 4, 24), (8, 2, 32), (6, 1, 40)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_the_kernel_agrees_with_sdpa_over_gathered_keys(heads, kv_heads, dim, block_size):
    contexts = [1, block_size - 1, block_size, block_size + 1, 3 * block_size, 97, 260]
    k_cache, v_cache, tables = pool(1, contexts, block_size, kv_heads, dim)
    q = torch.randn(len(contexts), heads, dim)
    kernel = cpu_decode.load(torch.device("cpu"), torch.float32, kv_heads, heads)
    step = kernel.build_step(list(range(len(contexts))), [c - 1 for c in contexts], tables, block_size, None)
    got = kernel.attend(q, k_cache, v_cache, step, sliding=False)
    torch.testing.assert_close(got, reference(q, k_cache, v_cache, tables, contexts, block_size), rtol=1e-4, atol=1e-5)


@needs_kernel
def test_a_sliding_layer_reads_only_its_window_and_never_a_block_given_back():
    block_size, window, contexts = 4, 6, [3, 6, 7, 30, 41]
    k_cache, v_cache, tables = pool(2, contexts, block_size, 2, 16)
    q = torch.randn(len(contexts), 4, 16)
    kernel = cpu_decode.load(torch.device("cpu"), torch.float32, 2, 4)
    # Blocks wholly behind the window are given back (-1 in the table); their slots hold garbage now.
    released = [[-1 if (b + 1) * block_size <= c - window else blk for b, blk in enumerate(t)] for t, c in zip(tables, contexts)]
    step = kernel.build_step([4, 0, 2, 1, 3], [c - 1 for c in contexts], released, block_size, window)
    windowed = kernel.attend(q, k_cache, v_cache, step, sliding=True)
    torch.testing.assert_close(windowed, reference(q, k_cache, v_cache, tables, contexts, block_size, window),
                               rtol=1e-4, atol=1e-5)
    # a full layer of the same step attends to every key (here the tables still hold every block)
    full = kernel.attend(q, k_cache, v_cache, kernel.build_step(list(range(5)), [c - 1 for c in contexts], tables,
                                                               block_size, window), sliding=False)
    torch.testing.assert_close(full, reference(q, k_cache, v_cache, tables, contexts, block_size), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(full[3], windowed[3], atol=1e-3)  # the window matters for the long ones


@needs_kernel
def test_the_step_scatters_the_decodes_rows_and_leaves_the_others():
    block_size, contexts = 4, [9, 17]
    k_cache, v_cache, tables = pool(3, contexts, block_size, 2, 8)
    kernel = cpu_decode.load(torch.device("cpu"), torch.float32, 2, 2)
    q = torch.randn(5, 2, 8)  # a step of five rows; the decodes are rows 3 and 1
    step = kernel.build_step([3, 1], [c - 1 for c in contexts], tables, block_size, None)
    out = torch.full_like(q, 7.0)
    step.attend(q, k_cache, v_cache, False, out)
    torch.testing.assert_close(out[[3, 1]], reference(q[[3, 1]], k_cache, v_cache, tables, contexts, block_size),
                               rtol=1e-4, atol=1e-5)
    assert bool((out[[0, 2, 4]] == 7.0).all())


def test_it_applies_only_to_float32_on_a_cpu_and_can_be_turned_off(monkeypatch):
    assert cpu_decode.load(torch.device("cpu"), torch.bfloat16, 1, 1) is None
    assert cpu_decode.load(torch.device("cpu"), torch.float32, 3, 4) is None  # query heads not a whole group per KV head
    monkeypatch.setenv("FERRY_CPU_DECODE_KERNEL", "0")
    assert cpu_decode.load(torch.device("cpu"), torch.float32, 1, 1) is None


def test_without_a_compiler_the_engine_keeps_gather_and_sdpa(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FERRY_KERNEL_CACHE", str(tmp_path))  # nothing built here yet
    monkeypatch.setenv("PATH", str(tmp_path))  # and no compiler to build it with
    monkeypatch.setattr(cpu_decode.sysconfig, "get_config_var", lambda name: None)
    assert cpu_decode.load(torch.device("cpu"), torch.float32, 1, 1) is None
    assert "could not be built" in caplog.text


def test_a_kernel_built_before_serves_a_machine_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("FERRY_KERNEL_CACHE", str(tmp_path))
    built = cpu_decode._build()  # built here, where there is a compiler
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # then none at all
    monkeypatch.setattr(cpu_decode.sysconfig, "get_config_var", lambda name: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_decode._compiler()
    assert cpu_decode._build() == built
    assert cpu_decode.load(torch.device("cpu"), torch.float32, 1, 1) is not None
