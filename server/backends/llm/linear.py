"""The model's Linear layers, with their fp32 CPU matmul run by oneDNN instead of MKL's sgemm.

A decode step of a small model is mostly Linear layers (docs/architecture.md, "Generation step cost").
On a CPU torch runs an fp32 `F.linear` through MKL's sgemm, and MKL takes its fastest (AVX-512) code
paths only on Intel processors: on the AMD EPYC this project measures on, `F.linear` ran at about 100
GFLOPS where oneDNN (the library torch also ships, which dispatches on the instruction set rather than
the vendor) ran the same shapes at 200-240, one thread, every shape a step has (48-1,024 rows, 512-2,752
columns). torch reaches oneDNN's fp32 matmul only through `torch.ops.mkldnn._linear_pointwise`, the op
its own compiler (inductor) emits for CPU Linear layers; the op is private, so `probe` runs it once at
load against `F.linear` and the engine keeps it only where it exists, runs and agrees. Results differ
from MKL's by float32 rounding (another summation order), as results from a different batch shape do.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same weight names) whose matmul `use_onednn` can hand to oneDNN."""

    onednn = False
    lora_a: torch.Tensor | None = None  # resident LoRA adapters' stacks, when the model serves them (lora.py)
    lora_b: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """`lora`: the step's LoraStep, when some of its rows use an adapter."""
        if self.onednn:
            rows = x.shape[0]
            padded = padded_rows(rows)
            rows_in = x if padded == rows else F.pad(x, (0, 0, 0, padded - rows))
            out = torch.ops.mkldnn._linear_pointwise(rows_in, self.weight, self.bias, "none", [None], "")
            if padded != rows:
                out = out[:rows]
        else:
            out = F.linear(x, self.weight, self.bias)
        if lora is not None and self.lora_a is not None:
            out = lora.add(out, x, self.lora_a, self.lora_b)
        return out


def padded_rows(rows: int) -> int:
    """`rows` rounded up the ladder of matmul shapes oneDNN is given: exact to 16, then 16 steps an octave."""
    if rows <= 16:
        return rows
    step = 1 << ((rows - 1).bit_length() - 5)
    return -(-rows // step) * step


def probe(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN's fp32 linear runs here and agrees with F.linear (a CPU, float32, a torch built with it)."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(shape, generator=generator) for shape in ((5, 64), (48, 64), (48,)))
        with torch.inference_mode():
            out = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [None], "")
            return bool(torch.allclose(out, F.linear(x, w, b), rtol=1e-4, atol=1e-4))
    except (AttributeError, RuntimeError) as exc:  # an op missing or refusing in this torch build
        log.info("oneDNN linear unavailable (%s): using F.linear", exc)
        return False


def use_onednn(model: nn.Module) -> int:
    """Route every Linear of `model` through oneDNN; returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        layer.onednn = True
    return len(layers)
