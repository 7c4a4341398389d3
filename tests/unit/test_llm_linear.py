"""The Linear layers' two matmul paths (linear.py) and the projections joined at load (llama.joined).
Token-for-token agreement with transformers, every family, is checked in tests/integration."""

from __future__ import annotations

import pytest
import torch

from server.backends.llm import linear
from server.backends.llm.llama import joined


@pytest.mark.skipif(not linear.probe(torch.device("cpu"), torch.float32),
                    reason="this torch build has no oneDNN fp32 linear (torch.backends.mkldnn unavailable), so "
                           "the engine keeps F.linear and there is no second path to compare")
@pytest.mark.parametrize("rows", [48, 37, 5, 1000])  # 37 and 1000 run padded (38, 1024), sliced back
def test_onednn_path_agrees_with_f_linear_where_the_probe_keeps_it(rows):
    torch.manual_seed(0)
    layer = linear.Linear(64, 96, bias=True)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        expected = layer(x)
        assert linear.use_onednn(layer) == 1 and layer.onednn
        got = layer(x)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_rows_onednn_sees_come_from_a_bounded_ladder():
    """Every token count up to 8,192 maps to one of about 160 shapes, none smaller than asked and at most
    6.25% larger, exact where decode steps live (16 rows and under): the primitive cache stays bounded."""
    padded = [linear.padded_rows(r) for r in range(1, 8193)]
    assert all(p >= r and p <= r * 1.0625 for r, p in zip(range(1, 8193), padded))
    assert padded[:16] == list(range(1, 17))
    assert len(set(padded)) <= 170
    assert all(linear.padded_rows(p) == p for p in set(padded))  # a rung maps to itself


@pytest.mark.parametrize("device, dtype", [("cpu", torch.bfloat16), ("cpu", torch.float64), ("meta", torch.float32)])
def test_probe_declines_anything_but_cpu_float32(device, dtype):
    assert not linear.probe(torch.device(device), dtype)


def test_joined_stacks_each_layers_projections_in_order():
    t = {name: torch.full((rows, 4), float(i)) for i, (name, rows) in enumerate(
        [("q_proj", 8), ("k_proj", 4), ("v_proj", 4), ("gate_proj", 6), ("up_proj", 6)])}
    state = {f"model.layers.0.{'self_attn' if n[0] in 'qkv' else 'mlp'}.{n}.weight": w for n, w in t.items()}
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(8)  # biases only where all three have one
    out = joined(state)
    qkv, gate_up = out["model.layers.0.self_attn.qkv_proj.weight"], out["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(qkv, torch.cat([t["q_proj"], t["k_proj"], t["v_proj"]]))
    assert torch.equal(gate_up, torch.cat([t["gate_proj"], t["up_proj"]]))
    assert "model.layers.0.self_attn.q_proj.bias" in out and "model.layers.0.self_attn.qkv_proj.bias" not in out
    assert not any(k.endswith(("q_proj.weight", "gate_proj.weight")) for k in out)


def test_a_layer_missing_a_part_keeps_its_parts_so_loading_reports_it():
    state = {"model.layers.1.self_attn.q_proj.weight": torch.ones(8, 4),
             "model.layers.1.self_attn.v_proj.weight": torch.ones(4, 4)}
    assert set(joined(state)) == set(state)
