"""What each family's config.json switches on (hf_config.py), and the keys sliding-window layers gather
(attention.py). The token-for-token checks against transformers are in tests/integration."""

from __future__ import annotations

import json

import pytest
import torch

from server.backends.llm.attention import build_group
from server.backends.llm.hf_config import LlamaArgs
from server.errors import ConfigError

BASE = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def args(tmp_path, **raw) -> LlamaArgs:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **raw}))
    return LlamaArgs.load(tmp_path)


def test_qwen3_normalises_q_and_k_and_reads_its_own_head_dim(tmp_path):
    a = args(tmp_path, model_type="qwen3", head_dim=128)
    assert (a.head_dim, a.qk_norm, a.attention_bias, a.output_bias) == (128, True, False, False)
    b = args(tmp_path, model_type="qwen3", head_dim=128, attention_bias=True)
    assert (b.attention_bias, b.output_bias) == (True, True)


@pytest.mark.parametrize("kind, bias, output_bias", [("qwen2", True, False), ("mistral", False, False),
                                                     ("llama", False, False)])
def test_biases_follow_each_family(tmp_path, kind, bias, output_bias):
    a = args(tmp_path, model_type=kind)
    assert (a.attention_bias, a.output_bias, a.qk_norm, a.head_dim) == (bias, output_bias, False, 16)
    assert args(tmp_path, model_type=kind, mlp_bias=True).mlp_bias == (kind == "llama")  # Llama's switch only


def test_which_layers_slide(tmp_path):
    assert args(tmp_path, model_type="mistral", sliding_window=4096).sliding_layers == (True,) * 4
    assert args(tmp_path, model_type="mistral", sliding_window=None).sliding_window is None
    off = args(tmp_path, model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert (off.sliding_window, off.sliding_layers) == (None, (False,) * 4)
    upper = args(tmp_path, model_type="qwen3", sliding_window=64, use_sliding_window=True, max_window_layers=2)
    assert (upper.sliding_window, upper.sliding_layers) == (64, (False, False, True, True))
    named = args(tmp_path, model_type="qwen2", sliding_window=64, use_sliding_window=True,
                 layer_types=["sliding_attention", "full_attention"] * 2)
    assert named.sliding_layers == (True, False, True, False)
    none = args(tmp_path, model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=28)
    assert none.sliding_window is None  # no layer from 28 on in a 4-layer model


@pytest.mark.parametrize("raw, words", [
    ({"model_type": "qwen2", "sliding_window": 64, "use_sliding_window": True, "layer_types": ["full_attention"]},
     "layer_types must name 4 layers"),
    ({"model_type": "qwen3", "sliding_window": 64, "use_sliding_window": True, "layer_types": ["chunked"] * 4},
     "sliding_attention"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"model_type": "gemma3"}, "supported: llama, mistral, qwen2, qwen3"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
     "partial_rotary_factor 0.25"),
])
def test_configs_refused_with_the_reason(tmp_path, raw, words):
    with pytest.raises(ConfigError, match=words):
        args(tmp_path, **raw)


def test_when_every_layer_slides_a_decode_gathers_only_its_window():
    table = list(range(50, 80))  # 30 blocks of 4: positions 0..119
    group = build_group([0], [1], [100], [table], 4, "cpu", window=8, full=False)
    positions = torch.arange(93, 101)  # the query at 100 sees 93..100
    assert group.context_slots.tolist() == [(torch.tensor(table)[positions // 4] * 4 + positions % 4).tolist()]
    assert group.mask is None and group.window_mask.all()


def test_a_prompt_chunk_sees_the_window_of_each_query():
    group = build_group([0], [3], [10], [list(range(10))], 4, "cpu", window=4, full=True)
    # some layer attends to everything: all 13 keys gathered, as the 4 whole blocks that hold them (3 masked)
    assert group.context_slots.shape == (1, 16) and group.flat_blocks.tolist() == [0, 1, 2, 3]
    window = group.mask_for(True)[0, 0]
    assert [row.nonzero().flatten().tolist() for row in window] == [[7, 8, 9, 10], [8, 9, 10, 11], [9, 10, 11, 12]]
    assert group.mask_for(False)[0, 0].sum(1).tolist() == [11, 12, 13]
    trimmed = build_group([0], [3], [10], [list(range(10))], 4, "cpu", window=4, full=False)
    assert trimmed.context_slots.tolist() == [list(range(7, 13))]  # block b holds slots 4b..4b+3: slot = position
    assert [row.nonzero().flatten().tolist() for row in trimmed.mask_for(True)[0, 0]] == [[0, 1, 2, 3], [1, 2, 3, 4],
                                                                                          [2, 3, 4, 5]]
