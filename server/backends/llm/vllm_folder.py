"""`backend: "vllm"`: a Triton vLLM backend folder served by Ferry's own generation engine.

The folder holds Triton's two files unchanged: a config.pbtxt naming the backend (inputs, outputs and the
decoupled policy are completed here, as Triton's vLLM backend completes them) and `<version>/model.json`,
vLLM's engine arguments. Those are translated once per version load (vllm_args.py) into the config's
`generation` section, so the ModelConfig RPC shows what is applied and everything downstream (engine,
scheduler, runner) reads the same settings as for `backend: llm`. Settings the config.pbtxt's own
`generation` section sets win over model.json's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from protos import model_config_pb2 as mc
from server.backends.base import Device
from server.backends.llm import vllm_args
from server.backends.llm.engine import LLMBackend

log = logging.getLogger(__name__)


def _source(model_json: Path) -> str:
    """model.json as messages show it: relative to the repository, never the server's own paths."""
    return f"{model_json.parent.parent.name}/{model_json.parent.name}/{model_json.name}"


class VllmFolderBackend(LLMBackend):
    name = "vllm"
    default_filename = "model.json"

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        args = vllm_args.read(model_path, _source(model_path))
        if args.ignored:
            log.warning("%s: vLLM engine argument%s that Ferry does not apply: %s; the model is served without %s",
                        _source(model_path), "s" if len(args.ignored) > 1 else "", ", ".join(args.ignored),
                        "them" if len(args.ignored) > 1 else "it")
        merged = mc.ModelGeneration()
        merged.CopyFrom(args.generation)
        merged.MergeFrom(config.generation)  # the config's own values win
        config.generation.CopyFrom(merged)
        super().complete_config(config, model_path, default_max_batch_size)

    def __init__(self, config: mc.ModelConfig, model_path: Path, device: Device):
        super().__init__(config, model_path, device)
        # complete_config applied (and warned about) the other arguments; an instance needs only `model`.
        self.folder = vllm_args.model_folder(model_path, _source(model_path))
