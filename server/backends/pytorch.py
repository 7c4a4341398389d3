"""PyTorch backend: TorchScript (`model.pt`) and torch.export programs (`model.pt2`).

Inputs are passed positionally in config order (TorchScript keeps no names we can rely on); a
tensor, a tuple/list (config output order) or a dict keyed by output name comes back.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from protos import model_config_pb2 as mc
from server.backends.base import Backend
from server.errors import BackendError, ConfigError, InvalidInputError

log = logging.getLogger(__name__)


class TorchBackend(Backend):
    name = "pytorch"
    default_filename = "model.pt"

    @classmethod
    def cuda_devices(cls) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        if not config.platform:
            config.platform = "pytorch_export" if model_path.suffix == ".pt2" else "pytorch_libtorch"
        for tensor in list(config.input) + list(config.output):
            if tensor.data_type == mc.TYPE_STRING:
                raise ConfigError(f"tensor '{tensor.name}': the pytorch backend cannot take TYPE_STRING tensors")

    def load(self) -> None:
        device = torch.device(str(self.device))
        if self.model_path.suffix == ".pt2":
            self.module = torch.export.load(str(self.model_path)).module().to(device)
        else:
            self.module = torch.jit.load(str(self.model_path), map_location=device)
            self.module.eval()
        self._inputs = [t.name for t in self.config.input]
        self._outputs = [t.name for t in self.config.output]
        log.info("model '%s': PyTorch on %s", self.config.name, self.device)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        device = torch.device(str(self.device))
        given = [name for name in self._inputs if name in inputs]
        if given != self._inputs[: len(given)]:  # positional arguments: a gap would shift the rest
            raise InvalidInputError(f"model '{self.config.name}' takes its inputs by position: an optional input "
                                    f"may only be left out after every input that is sent (order: {self._inputs})")
        with torch.inference_mode():
            # Views over request bytes are read-only; torch needs writable memory, so copy those once.
            args = [torch.from_numpy(v if v.flags.writeable else v.copy()).to(device) for v in (inputs[n] for n in given)]
            result = self.module(*args)
        return {name: t.detach().cpu().numpy() for name, t in self._named(result).items()}

    def _named(self, result) -> dict[str, torch.Tensor]:
        if isinstance(result, torch.Tensor):
            result = (result,)
        if isinstance(result, dict):
            return result
        if len(result) != len(self._outputs):
            raise BackendError(f"model returned {len(result)} outputs; the config declares {self._outputs}")
        return dict(zip(self._outputs, result))

    def held(self) -> tuple:
        return (self.module,) if getattr(self, "module", None) is not None else ()

    def unload(self) -> None:
        self.module = None
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()
