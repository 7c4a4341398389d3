"""The Llama family in plain torch (Llama, Mistral, Qwen2, Qwen3), reading Hugging Face weight names as saved."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from server.backends.llm import paged_kernel
from server.backends.llm.attention import StepMetadata, paged_attention
from server.backends.llm.hf_config import LlamaArgs
from server.backends.llm.linear import Linear
from server.errors import ConfigError


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    d = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = args.rope_scaling
    if not scaling:
        return inv.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return (inv / scaling["factor"]).float()
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wavelen, high_wavelen = old_len / low, old_len / high
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    raise ConfigError(f"rope_scaling type {kind!r} is not supported (supported: linear, llama3)")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos, sin: [T, 1, D/2]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, sliding: bool):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.sliding = sliding
        self.window = args.sliding_window if sliding else None
        # q, k and v in one matmul (one call, a wider GEMM); load_weights joins the saved three
        self.qkv_proj = Linear(args.hidden_size, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim,
                               bias=args.attention_bias)
        self.o_proj = Linear(args.num_heads * args.head_dim, args.hidden_size, bias=args.output_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x, cos, sin, cache: tuple[torch.Tensor, torch.Tensor], meta: StepMetadata):
        t, h, kvh = x.shape[0], self.heads, self.kv_heads
        qkv = self.qkv_proj(x, meta.lora).view(t, h + 2 * kvh, self.head_dim)
        if self.q_norm is not None:  # Qwen3 normalises each head before rotating it
            qk = torch.cat((self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + kvh])), dim=1)
        else:
            qk = qkv[:, : h + kvh]
        qk = apply_rope(qk, cos, sin)  # q's and k's heads rotated in one pass
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kvh :]
        k_cache, v_cache = cache
        k_cache.index_copy_(0, meta.slot_mapping, k)  # every slot of a step is distinct
        v_cache.index_copy_(0, meta.slot_mapping, v)
        if meta.varlen is not None:
            out = paged_kernel.attend(q.contiguous(), k_cache, v_cache, meta.varlen, self.window)
        else:
            out = paged_attention(q, k_cache, v_cache, meta, self.sliding)  # [T, H, D]
        return self.o_proj(out.reshape(t, -1), meta.lora)


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=args.mlp_bias)  # joined at load
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=args.mlp_bias)

    def forward(self, x, lora=None):
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up, lora)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, index: int):
        super().__init__()
        self.self_attn = Attention(args, args.sliding_layers[index])
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x), meta.lora)


class Backbone(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)

    def forward(self, input_ids, positions, caches, meta: StepMetadata, logits_index):
        # input_ids, positions: [T]; logits_index: [S] rows whose next-token logits are needed
        freqs = positions.float().unsqueeze(1) * self.inv_freq  # [T, D/2]
        dtype = self.lm_head.weight.dtype
        cos, sin = freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, caches):
            x = layer(x, cos, sin, cache, meta)
        x = self.model.norm(x[logits_index])
        return self.lm_head(x).float()  # [S, vocab]

    def load_weights(self, folder: Path) -> None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{folder}: no *.safetensors weights")
        state = {}
        for file in files:
            state.update(load_file(str(file)))
        if "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied embeddings
        missing, unexpected = self.load_state_dict(joined(state), strict=False)
        unexpected = [k for k in unexpected if "rotary_emb" not in k]
        if missing or unexpected:
            raise ConfigError(f"{folder}: weights do not match the config (missing {missing[:5]}, unexpected {unexpected[:5]})")


JOINED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def joined(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The saved (Hugging Face) weights with each layer's q/k/v and gate/up projections stacked into
    the one Linear each that the model runs; a layer missing a part keeps its parts, so the mismatch is reported."""
    state = dict(state)
    layers = {key.rsplit(".", 3)[0] for key in state if key.startswith("model.layers.")}  # "model.layers.N"
    for layer in layers:
        for name, parts in JOINED.items():
            for kind in ("weight", "bias"):
                names = [f"{layer}.{part}.{kind}" for part in parts]
                if all(n in state for n in names):
                    state[f"{layer}.{name}.{kind}"] = torch.cat([state.pop(n) for n in names])
    return state
