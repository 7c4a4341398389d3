"""ONNX models the benchmarks build on the fly (seeded random weights)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _weights(rng, name, shape):
    return numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name)


def _save(nodes, inputs, outputs, initializers, path: Path) -> Path:
    graph = helper.make_graph(nodes, path.parent.parent.name, inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def light_mlp(path: Path, seed: int = 0) -> Path:
    """x [-1, 256] -> three 1024-wide Gemm+Relu -> y [-1, 16]: per-request overhead dominates."""
    rng = np.random.default_rng(seed)
    sizes = [256, 1024, 1024, 1024]
    inits, nodes, prev = [], [], "x"
    for i in range(3):
        inits += [_weights(rng, f"W{i}", (sizes[i], sizes[i + 1])), numpy_helper.from_array(np.zeros(sizes[i + 1], np.float32), f"B{i}")]
        nodes += [helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [f"g{i}"]), helper.make_node("Relu", [f"g{i}"], [f"r{i}"])]
        prev = f"r{i}"
    inits.append(_weights(rng, "Wout", (1024, 16)))
    nodes.append(helper.make_node("MatMul", [prev, "Wout"], ["y"]))
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 256])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits, path)


def heavy_encoder(path: Path, seed: int = 0) -> Path:
    """x [-1, 32, 512] -> two token-wise 512->2048->512 blocks -> mean over tokens -> y [-1, 16]."""
    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    for i in range(2):
        inits += [_weights(rng, f"Up{i}", (512, 2048)), _weights(rng, f"Down{i}", (2048, 512))]
        nodes += [helper.make_node("MatMul", [prev, f"Up{i}"], [f"u{i}"]), helper.make_node("Relu", [f"u{i}"], [f"a{i}"]),
                  helper.make_node("MatMul", [f"a{i}", f"Down{i}"], [f"d{i}"])]
        prev = f"d{i}"
    inits.append(_weights(rng, "Head", (512, 16)))
    nodes += [helper.make_node("ReduceMean", [prev], ["pooled"], axes=[1], keepdims=0),
              helper.make_node("MatMul", ["pooled", "Head"], ["y"])]
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 32, 512])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits, path)


def token_encoder(path: Path, vocab: int = 1000, width: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """ids [-1, L] INT64 + lengths [-1, 1] -> self-attention encoder -> mean over the true tokens -> y [-1, 16].

    Cost grows with L (attention: with L^2). Keys past a row's length are masked out of attention and
    its padded positions out of the mean, so a padded batch answers exactly what each row alone would.
    """
    rng = np.random.default_rng(seed)
    inits = [_weights(rng, "embed", (vocab, width)), _weights(rng, "head", (width, 16)),
             numpy_helper.from_array(np.array(1.0 / np.sqrt(width), np.float32), "scale"),
             numpy_helper.from_array(np.array(-1e4, np.float32), "neg"),
             numpy_helper.from_array(np.array(1.0, np.float32), "onef"),
             *(numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (
                 ("zero", 0), ("one", 1), ("ax1", [1]), ("ax2", [2])))]
    node = helper.make_node
    nodes = [
        node("Gather", ["embed", "ids"], ["h0"]),  # [B, L, width]
        node("Shape", ["ids"], ["shape"]), node("Gather", ["shape", "one"], ["L"]),
        node("Range", ["zero", "L", "one"], ["pos"]),  # [L]
        node("Less", ["pos", "lengths"], ["valid"]),  # [B, L]
        node("Cast", ["valid"], ["validf"], to=TensorProto.FLOAT),
        node("Sub", ["onef", "validf"], ["invalid"]), node("Mul", ["invalid", "neg"], ["bias2"]),
        node("Unsqueeze", ["bias2", "ax1"], ["bias"]),  # [B, 1, L]: padded keys get -1e4
    ]
    prev = "h0"
    for i in range(layers):
        for w in ("q", "k", "v"):
            inits.append(_weights(rng, f"W{w}{i}", (width, width)))
            nodes.append(node("MatMul", [prev, f"W{w}{i}"], [f"{w}{i}"]))
        inits += [_weights(rng, f"Up{i}", (width, 4 * width)), _weights(rng, f"Down{i}", (4 * width, width))]
        nodes += [
            node("Transpose", [f"k{i}"], [f"kt{i}"], perm=[0, 2, 1]),
            node("MatMul", [f"q{i}", f"kt{i}"], [f"s{i}"]),  # [B, L, L]
            node("Mul", [f"s{i}", "scale"], [f"ss{i}"]), node("Add", [f"ss{i}", "bias"], [f"sb{i}"]),
            node("Softmax", [f"sb{i}"], [f"p{i}"], axis=-1),
            node("MatMul", [f"p{i}", f"v{i}"], [f"a{i}"]), node("Add", [prev, f"a{i}"], [f"r{i}"]),
            node("MatMul", [f"r{i}", f"Up{i}"], [f"u{i}"]), node("Relu", [f"u{i}"], [f"g{i}"]),
            node("MatMul", [f"g{i}", f"Down{i}"], [f"d{i}"]), node("Add", [f"r{i}", f"d{i}"], [f"h{i + 1}"]),
        ]
        prev = f"h{i + 1}"
    nodes += [
        node("Unsqueeze", ["validf", "ax2"], ["valid3"]), node("Mul", [prev, "valid3"], ["kept"]),
        node("ReduceSum", ["kept", "ax1"], ["total"], keepdims=0),  # [B, width]
        node("Cast", ["lengths"], ["lengthf"], to=TensorProto.FLOAT), node("Div", ["total", "lengthf"], ["pooled"]),
        node("MatMul", ["pooled", "head"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "L"]),
              helper.make_tensor_value_info("lengths", TensorProto.INT64, ["batch", 1])]
    return _save(nodes, inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits, path)


def string_identity(path: Path) -> Path:
    """IN [-1, -1] STRING -> OUT: ONNX Runtime reads strings as text, so each element must be UTF-8."""
    return _save([helper.make_node("Identity", ["IN"], ["OUT"])],
                 [helper.make_tensor_value_info("IN", TensorProto.STRING, ["batch", "n"])],
                 [helper.make_tensor_value_info("OUT", TensorProto.STRING, ["batch", "n"])], [], path)


def wide_mlp(path: Path, width: int = 4096, layers: int = 2, seed: int = 0) -> Path:
    """x [-1, width] -> `layers` width x width MatMuls -> y [-1, 16]: every request reads all the
    weights (134 MB at the defaults), so one instance serves tens of requests/s; a model whose capacity
    a client on the same machine can exceed tenfold, for overload runs."""
    rng = np.random.default_rng(seed)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        inits.append(_weights(rng, f"W{i}", (width, width)))
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        prev = f"r{i}"
    inits.append(_weights(rng, "Wout", (width, 16)))
    nodes.append(helper.make_node("MatMul", [prev, "Wout"], ["y"]))
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits, path)


def random_llama(folder: Path, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                 max_positions: int = 1024) -> Path:
    """A seeded random Llama saved by transformers, with a word-level tokenizer ("t0 t1 ..." -> ids)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=max_positions, bos_token_id=0, eos_token_id=1,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    word_tokenizer(folder, vocab)
    return folder


def word_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json ("t0 t1 ..." -> ids) beside a random model."""
    from tokenizers import Tokenizer
    from tokenizers import models as tokenizer_models
    from tokenizers import pre_tokenizers

    tok = Tokenizer(tokenizer_models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
