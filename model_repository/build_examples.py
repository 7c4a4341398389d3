"""Build the example models shipped in model_repository/ (seeded, so every run gives the same weights).

    python model_repository/build_examples.py

Each model folder holds a config and a numbered version folder, exactly as a user would lay one out.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent


def _save(graph, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9,
                              producer_name="ferry-examples")
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))


def simple() -> None:
    """Triton's classic 'simple' shape: two FP32 [batch, 16] inputs -> their sum and difference."""
    io = lambda n: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 16])  # noqa: E731
    graph = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]), helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "simple", [io("INPUT0"), io("INPUT1")], [io("OUTPUT0"), io("OUTPUT1")])
    _save(graph, HERE / "simple" / "1" / "model.onnx")


def classifier() -> None:
    """A two-layer MLP over 32 features -> 4 class probabilities (random seeded weights, demo only)."""
    rng = np.random.default_rng(7)
    weights = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)
               for name, shape in (("W1", (32, 64)), ("B1", (64,)), ("W2", (64, 4)), ("B2", (4,)))]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["features", "W1", "B1"], ["h"]), helper.make_node("Relu", ["h"], ["a"]),
         helper.make_node("Gemm", ["a", "W2", "B2"], ["logits"]), helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1)],
        "classifier", [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 32])],
        [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 4])], initializer=weights)
    _save(graph, HERE / "classifier" / "1" / "model.onnx")


def scaler_torchscript() -> None:
    """TorchScript: standardise 8 features with fixed seeded statistics."""
    import torch

    class Scaler(torch.nn.Module):
        def __init__(self):
            super().__init__()
            generator = torch.Generator().manual_seed(3)
            self.register_buffer("mean", torch.randn(8, generator=generator))
            self.register_buffer("scale", torch.rand(8, generator=generator) + 0.5)

        def forward(self, x):
            return (x - self.mean) / self.scale

    path = HERE / "scaler_torchscript" / "1" / "model.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(Scaler()).save(str(path))


DEMO_CORPUS = [
    "A ferry leaves when it is full or when it is time.",
    "Ferry batches requests so the hardware never idles and latency stays bounded.",
    "This tiny model has random weights: it demonstrates streaming, not language.",
    "Drop a real Hugging Face Llama, Qwen2 or Mistral folder next to it to serve one.",
]


def tiny_llama() -> None:
    """DEMO ONLY: a Llama-architecture model with random seeded weights and a small byte-level tokenizer.

    It shows continuous batching and streaming end to end; its text is noise. Weights are written in
    Hugging Face's layout (config.json, model.safetensors, tokenizer.json), exactly what a real model
    folder looks like.
    """
    import json

    import torch
    from safetensors.torch import save_file
    from tokenizers import ByteLevelBPETokenizer

    folder = HERE / "tiny_llama" / "1"
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(DEMO_CORPUS * 8, vocab_size=384, min_frequency=1, special_tokens=["<s>", "</s>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator().manual_seed(11)
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], 64), "model.norm.weight": (64,),
              "lm_head.weight": (config["vocab_size"], 64)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (176, 64), p + "mlp.up_proj.weight": (176, 64),
                       p + "mlp.down_proj.weight": (64, 176), p + "input_layernorm.weight": (64,),
                       p + "post_attention_layernorm.weight": (64,)})
    weights = {name: torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=generator) * 0.3
               for name, shape in sorted(shapes.items())}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


if __name__ == "__main__":
    simple()
    classifier()
    scaler_torchscript()
    tiny_llama()
    print(f"examples written under {HERE}")
