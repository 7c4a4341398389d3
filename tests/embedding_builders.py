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


def ship_onnx_export(version_dir: Path, weights_from: Path | None = None) -> Path:
    """`onnx/model.onnx` in the folder, as optimum exports it for sentence-transformers' ONNX backend (inputs
    input_ids, attention_mask and token_type_ids, output last_hidden_state), from this folder's encoder or,
    to make a graph that disagrees with it, another folder's."""
    import warnings

    import torch
    import transformers

    model = transformers.AutoModel.from_pretrained(str(weights_from or version_dir)).eval()

    class Traced(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

    ids = torch.tensor([[2, 10, 11, 12, 3], [2, 13, 3, 0, 0]])
    mask = (ids != 0).long()
    target = version_dir / "onnx" / "model.onnx"
    target.parent.mkdir(exist_ok=True)
    dynamic = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Traced(), (ids, mask, torch.zeros_like(ids)), str(target), opset_version=17, dynamo=False,
                          input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state"],
                          dynamic_axes={n: dynamic for n in ("input_ids", "attention_mask", "token_type_ids",
                                                             "last_hidden_state")})
    return target
