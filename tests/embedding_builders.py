"""Tiny random BERT encoders saved by sentence-transformers itself, with a WordPiece vocabulary made here.

No hub: the vocabulary is written from the letters, digits and a few words below, the encoder is a seeded
`BertModel` with a small config, and `SentenceTransformer.save` writes the folder (modules.json, the
Pooling module's config, Normalize) exactly as a downloaded model has it.
"""

from __future__ import annotations

import string
from pathlib import Path

WORDS = ("the ferry leaves when it is full or time batching what this server about embedding vectors "
         "retrieval search query document short long text model token").split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def write_vocab(folder: Path) -> int:
    pieces = list(string.ascii_lowercase + string.digits + string.punctuation)
    vocab = SPECIAL + WORDS + pieces + [f"##{c}" for c in string.ascii_lowercase + string.digits]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    return len(dict.fromkeys(vocab))


def build_encoder(version_dir: Path, pooling: str = "mean", normalize: bool = True, seed: int = 0, hidden: int = 64,
                  layers: int = 2, heads: int = 4, max_seq_length: int = 64, max_positions: int = 128) -> Path:
    """A sentence-transformers folder at `version_dir` (Ferry's `<model>/<version>/`); returns it."""
    import tempfile

    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:  # sentence-transformers before 6
        from sentence_transformers import models

    with tempfile.TemporaryDirectory() as scratch:
        base = Path(scratch) / "bert"
        vocab = write_vocab(base)
        transformers.BertTokenizerFast(vocab_file=str(base / "vocab.txt"), do_lower_case=True).save_pretrained(base)
        config = transformers.BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=hidden * 4,
                                         max_position_embeddings=max_positions, hidden_dropout_prob=0.0,
                                         attention_probs_dropout_prob=0.0)
        torch.manual_seed(seed)
        transformers.BertModel(config).eval().save_pretrained(base)
        encoder = models.Transformer(str(base), max_seq_length=max_seq_length)
        modules = [encoder, models.Pooling(hidden, pooling_mode=pooling)]
        if normalize:
            modules.append(models.Normalize())
        SentenceTransformer(modules=modules, device="cpu").save(str(version_dir))
    return version_dir


def reference(version_dir: Path, texts: list[str], batch_size: int = 32):
    """sentence-transformers' own vectors for `texts` (float32 numpy)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(version_dir), device="cpu")
    return model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
