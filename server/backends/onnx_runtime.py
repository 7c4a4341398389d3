"""ONNX Runtime backend.

onnxruntime-gpu lists the CUDA provider even where CUDA's libraries are missing, then logs an error
and silently runs on the CPU. So CUDA is probed once per process with a one-node model, and a model
asks for CUDA only if the probe really got it; the provider each session ends up with is reported.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from protos import model_config_pb2 as mc
from server.tensors import datatypes
from server.backends.base import Backend, Device, parameter
from server.errors import ConfigError

log = logging.getLogger(__name__)
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"


def _probe_model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])], "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


@functools.cache
def _cuda_works() -> bool:
    if CUDA not in ort.get_available_providers():
        return False
    ort.set_default_logger_severity(4)  # the failed provider load is expected here; keep it quiet
    try:
        session = ort.InferenceSession(_probe_model(), providers=[CUDA, CPU])
        return CUDA in session.get_providers()
    except Exception:  # noqa: BLE001 - any failure means "no CUDA"
        return False
    finally:
        ort.set_default_logger_severity(2)


GraphTensor = tuple[str, datatypes.DataType, tuple[int, ...]]  # name, dtype, dims (-1: free)


def _graph_tensors(model_path: Path) -> tuple[tuple[GraphTensor, ...], tuple[GraphTensor, ...]]:
    """The graph's inputs (initializers left out) and outputs. Reading them parses the whole file, weights
    included, and on-demand model control loads a model again every time it comes back: under
    bench/many_models.py that parse was a quarter of the loader thread's time (py-spy), and leaving it
    out took an idle server's load of a 4 MiB model from 23.4 to 21.3 ms. So it is kept per file version
    (path, size, modification time, inode), as plain tuples that hold nothing of the parsed model."""
    stat = model_path.stat()
    return _graph_io(str(model_path), stat.st_size, stat.st_mtime_ns, stat.st_ino)


@functools.lru_cache(maxsize=4096)
def _graph_io(path: str, size: int, mtime_ns: int, inode: int) -> tuple[tuple[GraphTensor, ...], tuple[GraphTensor, ...]]:
    model = onnx.load(path, load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    inputs = tuple(_tensor_info(v) for v in model.graph.input if v.name not in initializers)
    return inputs, tuple(_tensor_info(v) for v in model.graph.output)


def _tensor_info(value) -> GraphTensor:
    tensor_type = value.type.tensor_type
    np_dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    return value.name, datatypes.from_numpy(np_dtype), dims


# Triton's `optimization { graph { level } }` for ONNX Runtime: -1 basic, 1 extended, 2 none; anything else all.
_GRAPH_LEVELS = {-1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC, 1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                 2: ort.GraphOptimizationLevel.ORT_DISABLE_ALL}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
SHRINKAGE = "memory.enable_memory_arena_shrinkage"  # a run option: which arenas give memory back after each run


def session_options(config: mc.ModelConfig) -> ort.SessionOptions:
    """The session settings Triton's ONNX Runtime backend reads from a config, as every session Ferry makes
    reads them: thread counts, `execution_mode`, `enable_mem_arena`, `enable_mem_pattern`,
    `session.use_device_allocator_for_initializers` and the graph optimization level. A Triton repository
    that tunes them (a model with many branches run in parallel, many small models without an arena each)
    gets what it asked for, and a value Triton would refuse is refused here too, naming the parameter."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(parameter(config, "intra_op_thread_count", "0"))
    options.inter_op_num_threads = int(parameter(config, "inter_op_thread_count", "0"))
    mode = parameter(config, "execution_mode", "0").strip()
    if mode not in ("0", "1"):
        raise ConfigError(f"model '{config.name}': parameter execution_mode must be 0 (sequential) or 1 (parallel), "
                          f"not {mode!r}")
    options.execution_mode = ort.ExecutionMode.ORT_PARALLEL if mode == "1" else ort.ExecutionMode.ORT_SEQUENTIAL
    for key, attribute in (("enable_mem_arena", "enable_cpu_mem_arena"), ("enable_mem_pattern", "enable_mem_pattern")):
        value = parameter(config, key)
        if value is not None:
            setattr(options, attribute, _flag(config, key, value))
    level = config.optimization.graph.level if config.optimization.HasField("graph") else 0
    options.graph_optimization_level = _GRAPH_LEVELS.get(level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    allocator = parameter(config, "session.use_device_allocator_for_initializers")
    if allocator is not None:
        options.add_session_config_entry("session.use_device_allocator_for_initializers", allocator)
    # Spinning threads burn a core while idle and starve the gRPC side on small machines.
    spin = parameter(config, "allow_spinning", "0")
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return options


def run_options(config: mc.ModelConfig) -> ort.RunOptions | None:
    """`memory.enable_memory_arena_shrinkage` ('cpu:0', 'gpu:0', or both with ';'): those arenas hand back
    what a run took beyond their first allocation, after every run. None without it."""
    shrink = parameter(config, SHRINKAGE)
    if not shrink:
        return None
    arena = parameter(config, "enable_mem_arena")
    if "cpu" in shrink and arena is not None and not _flag(config, "enable_mem_arena", arena):
        raise ConfigError(f"model '{config.name}': parameter {SHRINKAGE} names the CPU arena ({shrink!r}) but "
                          "enable_mem_arena turns it off: drop one of the two")
    options = ort.RunOptions()
    options.add_run_config_entry(SHRINKAGE, shrink)
    return options


def _flag(config: mc.ModelConfig, key: str, value: str) -> bool:
    text = value.strip().lower()
    if text not in _TRUE + _FALSE:
        raise ConfigError(f"model '{config.name}': parameter {key} must be true or false (1 or 0), not {value!r}")
    return text in _TRUE


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    default_filename = "model.onnx"
    bytes_as_text = True

    @classmethod
    def cuda_devices(cls) -> int:
        if not _cuda_works():
            return 0
        import torch  # only to count devices, and only where CUDA already works

        return torch.cuda.device_count()

    @classmethod
    @functools.cache
    def prime(cls) -> None:
        """One run of the one-node probe. The first session a process makes costs about 9 MiB more than the
        next (a 4 MiB-weight MatMul measured 13.7 MiB first, then 5.1 MiB each), and that is the runtime's,
        not the model's."""
        session = ort.InferenceSession(_probe_model(), session_options(mc.ModelConfig()), providers=[CPU])
        session.run(None, {"x": np.ones(1, np.float32)})

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        """Fill inputs, outputs and batching from the graph, as Triton's auto-complete does."""
        if not config.platform:
            config.platform = "onnxruntime_onnx"
        if config.input and config.output:
            return
        inputs, outputs = _graph_tensors(model_path)
        batchable = all(dims and dims[0] == -1 for _, _, dims in inputs + outputs)
        if not config.input and not config.output and config.max_batch_size == 0 and batchable:
            config.max_batch_size = default_max_batch_size
        skip = 1 if config.max_batch_size > 0 else 0
        for target, values in ((config.input, inputs), (config.output, outputs)):
            if target:
                continue
            for name, dtype, dims in values:
                target.add(name=name, data_type=mc.DataType.Value(dtype.config), dims=dims[skip:])

    def load(self) -> None:
        options = session_options(self.config)
        self._run_options = run_options(self.config)
        if self.device.kind == "cuda":
            providers = [(CUDA, {"device_id": self.device.index}), CPU]
        else:
            providers = [CPU]
        self.session = ort.InferenceSession(str(self.model_path), options, providers=providers)
        self.provider = self.session.get_providers()[0]
        if self.device.kind == "cuda" and self.provider != CUDA:
            self.device = Device("cpu")
        self._check_names()
        self._strings = {v.name for v in self.session.get_inputs() if v.type == "tensor(string)"}
        self._outputs = [o.name for o in self.config.output]
        log.info("model '%s': ONNX Runtime on %s (%s)", self.config.name, self.device, self.provider)

    def _check_names(self) -> None:
        declared = {i.name for i in self.session.get_inputs()}, {o.name for o in self.session.get_outputs()}
        for kind, tensors, names in (("input", self.config.input, declared[0]), ("output", self.config.output, declared[1])):
            for tensor in tensors:
                if tensor.name not in names:
                    raise ConfigError(
                        f"{kind} '{tensor.name}' in the config is not an {kind} of {self.model_path.name} "
                        f"(the model has {sorted(names)})"
                    )

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {n: self._to_ort_strings(v) if n in self._strings else v for n, v in inputs.items()}
        values = self.session.run(self._outputs, feed, self._run_options)
        return dict(zip(self._outputs, values))

    @staticmethod
    def _to_ort_strings(array: np.ndarray) -> np.ndarray:
        # ONNX Runtime stringifies bytes objects ("b'..'"), so hand it text.
        flat = [v.decode() if isinstance(v, bytes) else v for v in array.reshape(-1)]
        return np.array(flat, dtype=object).reshape(array.shape)

    def held(self) -> tuple:
        return (self.session,) if getattr(self, "session", None) is not None else ()

    def unload(self) -> None:
        self.session = None

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "execution_provider": self.provider}
