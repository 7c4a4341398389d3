"""Tiny Hugging Face-format language models built with `transformers` itself, plus a local tokenizer.

Random weights give near-tied logits where float summation order can flip an argmax; a large
initializer range spreads the logits so greedy decoding is stable across implementations.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the ferry leaves when it is full or when it is time",
    "batching is what this server is about",
    "ünïcödé wörds and émojis 🚢⚓ keep the detokenizer honest",
    "continuous batching joins requests at every decode step",
] * 4


def build_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE trained on a few sentences; returns its vocabulary size."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(CORPUS, vocab_size=vocab_size, min_frequency=1, special_tokens=["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()


def build_model(folder: Path, family: str = "llama", seed: int = 0, layers: int = 2, max_positions: int = 512,
                attention_scale: float = 1.0, random_biases: bool = False, **overrides) -> Path:
    """Save a random `family` model (llama, mistral, qwen2 or qwen3) with transformers' save_pretrained,
    and a tokenizer; `overrides` go to the config (head_dim, sliding_window, rope_parameters...).
    `attention_scale` multiplies every attention output projection: 0 makes the next token a function of
    the current one alone, so greedy output soon loops (drafts from earlier output get accepted); a
    little above 0 keeps it looping with breaks that depend on the context. `random_biases`: transformers
    starts every bias at zero, where a model that ignored them would still match; this draws them at random."""
    import torch
    import transformers

    vocab = build_tokenizer(folder)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  initializer_range=0.5, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    families = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_theta=10000.0)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                    dict(rope_theta=10000.0, sliding_window=None)),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(rope_theta=1e6, tie_word_embeddings=True)),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(rope_theta=1e6, head_dim=16)),
    }
    if family not in families:
        raise ValueError(family)
    config_cls, model_cls, defaults = families[family]
    config = config_cls(**{**common, **defaults, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if random_biases:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and module.bias is not None:
                    module.bias.normal_(0.0, 0.5)
    if attention_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(attention_scale)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def reference_greedy(folder: Path, prompt: list[int], max_new_tokens: int, **config_overrides) -> list[int]:
    """transformers' own greedy generate: the independent implementation Ferry is checked against.
    `config_overrides` change the config as loaded (attn_implementation, or switching a feature off to
    show that it matters)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                              **config_overrides).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        # An explicit mask: without one, generate() infers it from pad_token_id and would mask every
        # prompt token equal to it (id 0 is also the bos token here), computing a different sequence.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def llm_config(block_size: int = 4, num_kv_blocks: int = 256, **extra) -> str:
    fields = {"block_size": block_size, "num_kv_blocks": num_kv_blocks, **extra}
    return "backend: llm\ngeneration: " + json.dumps(fields) + "\n"
