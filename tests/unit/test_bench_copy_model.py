"""bench/copy_model.py: the widened model computes what the small one does; lookup share by hand."""

from __future__ import annotations

import pytest

from bench import copy_model

torch = pytest.importorskip("torch", reason="torch builds the models (test extra)")
transformers = pytest.importorskip("transformers", reason="transformers builds the models (test extra)")


def test_the_widened_model_gives_the_small_models_logits(tmp_path):
    small = copy_model.models.random_llama(tmp_path / "small", vocab=64, hidden=32, intermediate=48, layers=2,
                                           heads=4, kv_heads=4, max_positions=64)
    wide = copy_model.widened(small, tmp_path / "wide", hidden=96, intermediate=80, layers=3)
    ids = torch.tensor([[0, 5, 9, 33, 2, 5, 9, 40, 61, 7]])
    load = lambda folder: transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()  # noqa: E731
    a, b = load(small), load(wide)
    assert b.config.hidden_size == 96 and b.config.num_hidden_layers == 3
    with torch.no_grad():
        x, y = a(ids).logits, b(ids).logits
    # only RMSNorm's epsilon differs (3x here), which tells on a random model's tiny activations alone
    assert (x - y).abs().max() <= 0.01 * x.abs().max() and torch.equal(x.argmax(-1), y.argmax(-1))


def test_lookup_share_counts_the_tokens_prompt_lookup_would_have_proposed():
    # prompt 3 4 5 6; output 4 5 9: "4" follows the latest 3? no, history ends in 6, never seen before -> miss;
    # then history ...6 4: 4 occurred before, followed by 5 -> hit; then ...4 5: followed by 6, not 9 -> miss
    assert copy_model.lookup_share([3, 4, 5, 6], [4, 5, 9]) == pytest.approx(1 / 3)
