"""What runs an embedding model's encoder: transformers' own module in torch, or the same graph in ONNX Runtime.

On a CPU, ONNX Runtime runs a small encoder's forward with less fixed cost than torch eager (about 1.4 ms
against 4-6 ms a call for one short text on the bench's 4-layer BERT, 10-25% less at the batch shapes bin
packing makes; bench/RESULTS.md 2026-12-07), and bin packing runs many small batches. So the `auto` runtime,
the default on a CPU, exports the encoder once at load with torch's exporter and keeps the ONNX graph only if
it gives transformers' answer on a probe batch of uneven, padded rows; anything else (an architecture the
exporter cannot trace, a graph that disagrees, a CUDA device) keeps torch. A folder that already carries
an export (`onnx/model.onnx`, as sentence-transformers' ONNX backend and optimum write it) is used as it is.

Both runtimes take right-padded int64 ids and mask and give the last hidden state as a torch tensor on the
model's device, so pooling is written once (embedding.py).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from server.backends.base import Device
from server.errors import ConfigError

log = logging.getLogger(__name__)
RUNTIMES = ("auto", "torch", "onnxruntime")
PROBE_ATOL = 1e-4  # fp32 graphs of one encoder agree to ~2e-6 here; a traced branch gone wrong is off by far more
_SHIPPED_EXPORT = Path("onnx") / "model.onnx"
_EXPORTING = threading.Lock()  # torch's exporter keeps global state; models load on threads of their own


class TorchEncoder:
    runtime, source = "torch", "transformers"

    def __init__(self, model: torch.nn.Module, device: Device):
        self.model, self.device = model, str(device)

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(input_ids=torch.from_numpy(ids).to(self.device),
                              attention_mask=torch.from_numpy(mask).to(self.device)).last_hidden_state


class OnnxEncoder:
    runtime = "onnxruntime"

    def __init__(self, graph: Path, options: ort.SessionOptions, source: str):
        self.source = source
        self.session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        unknown = set(self.inputs) - {"input_ids", "attention_mask", "token_type_ids"}
        if unknown:
            raise ConfigError(f"{graph}: an encoder graph takes input_ids, attention_mask and optionally "
                              f"token_type_ids; this one also wants {sorted(unknown)}")
        self.segments = "token_type_ids" in self.inputs  # optimum's BERT exports take them; all zeros here
        outputs = [o.name for o in self.session.get_outputs()]
        self.output = "last_hidden_state" if "last_hidden_state" in outputs else outputs[0]

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        feed = {"input_ids": ids, "attention_mask": mask}
        if self.segments:
            feed["token_type_ids"] = np.zeros_like(ids)
        (hidden,) = self.session.run([self.output], feed)
        return torch.from_numpy(hidden)


def load_encoder(model: torch.nn.Module, encoder_dir: Path, device: Device, runtime: str,
                 options: ort.SessionOptions, name: str) -> TorchEncoder | OnnxEncoder:
    """The runtime the config asks for (`auto`: ONNX Runtime on a CPU where the graph checks out)."""
    if runtime not in RUNTIMES:
        raise ConfigError(f"model '{name}': parameter encoder_runtime must be one of {list(RUNTIMES)}, "
                          f"not '{runtime}'")
    torch_encoder = TorchEncoder(model, device)
    if runtime == "torch" or (runtime == "auto" and device.kind != "cpu"):
        return torch_encoder
    if device.kind != "cpu":
        raise ConfigError(f"model '{name}': encoder_runtime 'onnxruntime' runs on the CPU only; this instance "
                          f"is on {device} (use 'torch' or 'auto' there)")
    shipped = encoder_dir / _SHIPPED_EXPORT
    try:
        if shipped.is_file():
            onnx_encoder = OnnxEncoder(shipped, options, source=str(_SHIPPED_EXPORT))
        else:
            onnx_encoder = _export(model, options)
        error = _probe_error(torch_encoder, onnx_encoder)
    except Exception as exc:  # noqa: BLE001 - the exporter's failures have no common type
        if runtime == "onnxruntime":
            raise ConfigError(f"model '{name}': the encoder cannot run in ONNX Runtime ({exc})") from None
        log.warning("model '%s': encoder stays in torch: ONNX Runtime could not take it (%s)", name, exc)
        return torch_encoder
    if error > PROBE_ATOL:
        message = f"the ONNX graph ({onnx_encoder.source}) differs from transformers by {error:.2e} on a probe batch"
        if runtime == "onnxruntime":
            raise ConfigError(f"model '{name}': {message}")
        log.warning("model '%s': encoder stays in torch: %s", name, message)
        return torch_encoder
    log.info("model '%s': encoder in ONNX Runtime (%s; probe within %.1e of transformers)", name, onnx_encoder.source,
             error)
    return onnx_encoder


class _Traced(torch.nn.Module):
    """The encoder with positional inputs and one output, the shape torch's exporter traces."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _uneven_batch(config, lengths: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded rows of the given lengths, padded as the backend pads (a mask with zeros, so no branch
    for 'no padding' is traced; pad ids where they are, since RoBERTa derives positions from them)."""
    rng = np.random.default_rng(seed)
    pad = config.pad_token_id or 0
    ids = rng.integers(0, config.vocab_size, (len(lengths), max(lengths))).astype(np.int64)
    ids[ids == pad] = (pad + 1) % config.vocab_size
    mask = (np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    ids[mask == 0] = pad
    return ids, mask


def _export(model: torch.nn.Module, options: ort.SessionOptions) -> OnnxEncoder:
    ids, mask = _uneven_batch(model.config, (7, 3), seed=0)
    folder = Path(tempfile.mkdtemp(prefix="ferry-encoder-"))
    started = time.perf_counter()
    try:
        with _EXPORTING, warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's warnings are about branches the probe then checks
            dynamic = {0: "rows", 1: "tokens"}
            torch.onnx.export(_Traced(model), (torch.from_numpy(ids), torch.from_numpy(mask)),
                              str(folder / "encoder.onnx"), input_names=["input_ids", "attention_mask"],
                              output_names=["last_hidden_state"], opset_version=17, dynamo=False,
                              dynamic_axes={"input_ids": dynamic, "attention_mask": dynamic,
                                            "last_hidden_state": dynamic})
        # the session holds the weights from here on, so the file goes at once
        encoder = OnnxEncoder(folder / "encoder.onnx", options, source="exported at load")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    log.debug("encoder exported to ONNX in %.1f s", time.perf_counter() - started)
    return encoder


def _probe_error(reference: TorchEncoder, candidate: OnnxEncoder) -> float:
    """Largest difference over the real (unpadded) positions of a batch unlike the traced one."""
    ids, mask = _uneven_batch(reference.model.config, (5, 12, 1), seed=1)
    expected = reference(ids, mask).float().cpu().numpy()
    got = candidate(ids, mask).float().numpy()
    if got.shape != expected.shape:
        return float("inf")
    return float(np.abs(expected - got)[mask.astype(bool)].max())
