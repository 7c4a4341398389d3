"""Triton's `triton_python_backend_utils`, as a model process sees it (`import triton_python_backend_utils`).

The names, signatures and codes are Triton's (python_backend README), so a Triton model.py runs
unchanged; the code is Ferry's. Everything that leaves the process (BLS calls, responses of a
decoupled model, metrics, log lines, model control) goes through the process's one `Host`
(server/backends/python/child.py), which the model process installs with `install` before it imports
model.py: one per process, as the module itself is, since Triton's API is module-level functions.
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct

import ml_dtypes
import numpy as np

from server.backends import nvidia
from server.backends.python import protocol as p

_host = None  # the process's Host, set once by `install`


def install(host) -> None:
    global _host  # Triton's API is module-level: one host per model process
    _host = host


_model_dir = ""  # the model's version folder, set by the model process before model.py runs


def set_model_dir(path: str) -> None:
    global _model_dir  # module-level, as Triton's get_model_dir
    _model_dir = path


def get_model_dir() -> str:
    """The model's version folder: for a Python-based backend, the served model's, not the backend's
    (where the shared model.py finds each model's own files)."""
    return _model_dir


def _the_host():
    if _host is None:
        raise TritonModelException("this call needs a running model process (it works inside Ferry's Python backend)")
    return _host


TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2


class MemoryType(enum.IntEnum):
    """Where a BLS call's outputs are wanted (Triton's `pb_utils.MemoryType`)."""

    TRITONSERVER_MEMORY_GPU = 0
    TRITONSERVER_MEMORY_CPU = 1


TRITONSERVER_MEMORY_GPU = MemoryType.TRITONSERVER_MEMORY_GPU
TRITONSERVER_MEMORY_CPU = MemoryType.TRITONSERVER_MEMORY_CPU


class PreferredMemory:
    """`InferenceRequest(..., preferred_memory=PreferredMemory(TRITONSERVER_MEMORY_CPU, 0))`: the memory a
    BLS call's output tensors should be in. Ferry's are always host arrays: the CPU is honoured; the GPU
    is refused on a machine without one, and elsewhere answered with host tensors (is_cpu() true), said
    once in the server's log."""

    def __init__(self, preferred_memory_type: MemoryType, preferred_device_id: int = 0):
        if preferred_memory_type not in (TRITONSERVER_MEMORY_GPU, TRITONSERVER_MEMORY_CPU):
            raise TypeError(f"PreferredMemory: preferred_memory_type must be pb_utils.TRITONSERVER_MEMORY_GPU or "
                            f"TRITONSERVER_MEMORY_CPU, got {preferred_memory_type!r}")
        self.preferred_memory_type = MemoryType(preferred_memory_type)
        self.preferred_device_id = int(preferred_device_id)

    def _checked(self) -> None:
        """Before the call is sent."""
        global _gpu_said
        if self.preferred_memory_type != TRITONSERVER_MEMORY_GPU:
            return
        if nvidia.gpu_count() == 0:
            raise TritonModelException("InferenceRequest: preferred_memory asks TRITONSERVER_MEMORY_GPU but this "
                                       "machine has no GPU; leave preferred_memory out (or ask "
                                       "TRITONSERVER_MEMORY_CPU) to get the outputs as host tensors")
        if not _gpu_said:
            _gpu_said = True
            Logger.log_warn("BLS outputs are host tensors (is_cpu() is true): preferred_memory "
                            "TRITONSERVER_MEMORY_GPU is not honoured by Ferry's Python backend")


_gpu_said = False

TRITON_STRING_TO_NUMPY = {
    "TYPE_BOOL": bool, "TYPE_UINT8": np.uint8, "TYPE_UINT16": np.uint16, "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64, "TYPE_INT8": np.int8, "TYPE_INT16": np.int16, "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64, "TYPE_FP16": np.float16, "TYPE_FP32": np.float32, "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}
_TRITON_TYPES = [None, np.bool_, np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32, np.int64,
                 np.float16, np.float32, np.float64, np.object_]  # TRITONSERVER_DataType numbers
_BF16 = np.dtype(ml_dtypes.bfloat16)
_TRITON_BF16 = 14  # TRITONSERVER_TYPE_BF16; numpy has no type for it, so the tables above leave it out (as Triton's do)


def triton_string_to_numpy(triton_type_string: str):
    return TRITON_STRING_TO_NUMPY[triton_type_string]


def triton_to_numpy_type(data_type: int):
    return _TRITON_TYPES[data_type] if 0 < data_type < len(_TRITON_TYPES) else None


def numpy_to_triton_type(data_type) -> int | None:
    if data_type in (np.object_, np.bytes_) or np.dtype(data_type).kind in "OSU":
        return 13
    if np.dtype(data_type) == _BF16:
        return _TRITON_BF16
    for number, numpy_type in enumerate(_TRITON_TYPES[1:13], start=1):
        if np.dtype(data_type) == np.dtype(numpy_type):
            return number
    return None


def serialize_byte_tensor(input_tensor: np.ndarray):
    if input_tensor.size == 0:
        return ()
    if input_tensor.dtype != np.object_ and input_tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in input_tensor.flatten(order="C"):
        data = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts += [struct.pack("<I", len(data)), data]
    return b"".join(parts)


def deserialize_bytes_tensor(encoded_tensor) -> np.ndarray:
    items, offset, data = [], 0, bytes(encoded_tensor)
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        items.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return np.array(items, dtype=np.object_)


class TritonError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = (
        p.UNKNOWN, p.INTERNAL, p.NOT_FOUND, p.INVALID_ARG, p.UNAVAILABLE, p.UNSUPPORTED, p.ALREADY_EXISTS, p.CANCELLED)

    def __init__(self, message: str, code: int = p.INTERNAL):
        self._message, self._code = str(message), int(code)

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r}, {self._code})"


class TritonModelException(Exception):
    """Raise it from model code: the requests of that execute fail with its message."""

    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class Tensor:
    """A named numpy array (on the CPU: this server runs Python models' tensors on the host)."""

    def __init__(self, name: str, data, dtype=None):
        if not isinstance(name, str) or data is None:  # Triton's pybind11 signature refuses them so
            raise TypeError(f"Tensor(name: str, data: numpy array): got {type(name).__name__} and {type(data).__name__}")
        array = data if isinstance(data, np.ndarray) else np.asarray(data, dtype=dtype)
        if array.dtype.kind in "SU":
            array = array.astype(np.object_)
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    @property
    def array(self) -> np.ndarray:
        """The data whatever its dtype, BF16 included: what Ferry's own code sends on (not part of Triton's API)."""
        return self._array

    def as_numpy(self) -> np.ndarray:
        if self._array.dtype == _BF16:
            raise TritonModelException(f"tensor '{self._name}': tensor dtype is BF16 and cannot be converted to numpy; "
                                       "use to_dlpack() (torch.utils.dlpack.from_dlpack gives a torch.bfloat16 tensor)")
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int | None:
        return numpy_to_triton_type(self._array.dtype)

    def is_cpu(self) -> bool:
        return True

    def to_dlpack(self):
        if self._array.dtype == np.object_:
            raise TritonModelException(f"tensor '{self._name}' holds BYTES, which DLPack cannot carry")
        if self._array.dtype == _BF16:  # numpy's DLPack has no bfloat16: torch carries it (models using BF16 have torch)
            return _bf16_capsule(self._array)
        if not self._array.flags.writeable:  # DLPack before 1.0 cannot say read-only: hand over a copy
            return self._array.copy().__dlpack__()
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name: str, dlpack) -> Tensor:
        """From a DLPack capsule or any object with `__dlpack__` (a torch tensor, say); host memory only."""
        if dlpack is None or not name:
            raise TritonModelException("Tensor.from_dlpack needs a tensor name and a DLPack capsule or an object "
                                       "with __dlpack__")
        if hasattr(dlpack, "__dlpack_device__") and dlpack.__dlpack_device__()[0] != 1:
            raise TritonModelException(f"tensor '{name}' is on a GPU; Ferry's Python backend takes host tensors only")
        source = dlpack if hasattr(dlpack, "__dlpack__") else _Capsule(dlpack)
        try:
            return Tensor(name, np.from_dlpack(source))
        except (RuntimeError, BufferError):  # bfloat16, which numpy's DLPack import refuses; the capsule stays unused
            return Tensor(name, _bf16_array(name, dlpack))

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={list(self._array.shape)}, dtype={self._array.dtype})"


def _bf16_capsule(array: np.ndarray):
    import torch  # only BF16 needs it

    bits = np.ascontiguousarray(array if array.flags.writeable else array.copy()).view(np.int16)
    return torch.utils.dlpack.to_dlpack(torch.from_numpy(bits).view(torch.bfloat16))


def _bf16_array(name: str, dlpack) -> np.ndarray:
    """A host bfloat16 DLPack tensor as numpy's ml_dtypes.bfloat16, sharing its memory."""
    import torch

    tensor = torch.utils.dlpack.from_dlpack(dlpack)
    if tensor.dtype != torch.bfloat16:
        raise TritonModelException(f"tensor '{name}': DLPack dtype {tensor.dtype} has no Triton datatype")
    return tensor.contiguous().view(torch.int16).numpy().view(_BF16)


class _Capsule:
    """A bare DLPack capsule, dressed as the object np.from_dlpack expects."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)


def _checked_parameters(parameters) -> dict:
    """Triton's rule for the parameters model code gives a request or a response (and its words): a dict
    of str -> bool, int or str; anything else raises, so it never reaches a client half-encoded."""
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise TritonModelException(f"Expect dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str)):
            raise TritonModelException(f"Expect parameters values to have type bool/int/str, found type {type(value)}")
    return dict(parameters)


def _tensors(given, owner: str, field: str) -> list[Tensor]:
    """A list of Tensors, refused as Triton's pybind11 bindings refuse it: not a list (TypeError), or an
    element that is not a Tensor (TritonModelException)."""
    if not isinstance(given, (list, tuple)):
        raise TypeError(f"{owner}: {field} must be a list of pb_utils.Tensor, got {type(given).__name__}")
    if not all(isinstance(t, Tensor) for t in given):
        raise TritonModelException(f"{owner}: every element of {field} must be a pb_utils.Tensor")
    return list(given)


def _check_request_args(model_name, requested_output_names, request_id, correlation_id, flags, model_version) -> None:
    """Triton's pybind11 signature of InferenceRequest: arguments of another type are a TypeError."""
    wrong = [name for name, value, types in (
        ("model_name", model_name, (str, bytes)), ("request_id", request_id, str),
        ("correlation_id", correlation_id, (int, str)), ("flags", flags, int), ("model_version", model_version, int))
        if not isinstance(value, types)]
    if not isinstance(requested_output_names, (list, tuple)) or not all(
            isinstance(n, str) for n in requested_output_names):
        wrong.append("requested_output_names")
    if wrong:
        raise TypeError(f"InferenceRequest: {', '.join(wrong)} of the wrong type")


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] = (), error: TritonError | None = None,
                 parameters: dict | None = None):
        self._outputs = _tensors(output_tensors, "InferenceResponse", "output_tensors")
        self._error = error
        self._parameters = _checked_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return json.dumps(self._parameters)


SENDER_CLOSED = "Unable to send response. Response sender has been closed."  # Triton's words, which model code may test


class InferenceResponseSender:
    """A decoupled model's way to answer: 0..N `send`s, the last with TRITONSERVER_RESPONSE_COMPLETE_FINAL."""

    def __init__(self, host, call: int):
        self._host, self._call = host, call
        self._closed = False

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self._closed:
            raise TritonModelException(SENDER_CLOSED)
        final = bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        self._closed = final
        self._host.respond(self._call, response, final)

    def is_cancelled(self) -> bool:
        return self._host.cancelled(self._call)


class InferenceTrace:
    """A request's trace, as `request.trace()` gives it: passed as `InferenceRequest(trace=...)`, it makes
    the BLS call's trace a child of that request's (the request it serves, in a batch of several). A call
    made without one is a child of the first traced request of the execute that made it."""

    def __init__(self, call: int, index: int):
        self._ref = (call, index)  # the EXEC or STREAM call, the request's place in it

    def get_context(self, mode: str = "opentelemetry") -> str | None:
        """Triton gives the OpenTelemetry context to model code here; Ferry keeps it in the server: None."""
        return None


_REQUIRED = object()  # an argument Triton's InferenceRequest has no default for


class InferenceRequest:
    """A request given to execute, or (built by model code) a BLS request to another model."""

    def __init__(self, model_name: str = _REQUIRED, inputs: list[Tensor] = _REQUIRED,
                 requested_output_names: list[str] = _REQUIRED, request_id: str = "", correlation_id=0, flags: int = 0,
                 timeout: int = 0, model_version: int = -1, parameters: dict | None = None, preferred_memory=None,
                 trace: InferenceTrace | None = None, _call: int | None = None, _index: int = 0):
        if _call is None:  # built by model code: its arguments are checked as Triton's bindings check them
            missing = [name for name, value in (("model_name", model_name), ("inputs", inputs),
                                                ("requested_output_names", requested_output_names))
                       if value is _REQUIRED]
            if missing:  # required in Triton's signature: a request to nobody, or for nothing, is a coding error
                raise TypeError(f"InferenceRequest: missing required argument(s) {', '.join(missing)}")
            _check_request_args(model_name, requested_output_names, request_id, correlation_id, flags, model_version)
            inputs = _tensors(inputs, "InferenceRequest", "inputs")
        self.model_name = model_name.decode() if isinstance(model_name, bytes) else str(model_name)  # a BYTES element
        self.model_version = model_version
        self._inputs = list(inputs)
        self._requested = list(requested_output_names)
        self._request_id, self._correlation_id, self._flags, self._timeout = request_id, correlation_id, flags, timeout
        # a request given to execute carries the client's parameters as they came (a double too)
        self._parameters = dict(parameters or {}) if _call is not None else _checked_parameters(parameters)
        self._call = _call  # set on requests handed to execute: which call of the server they belong to
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        self._trace = InferenceTrace(_call, _index) if _call is not None else trace
        if preferred_memory is not None and not isinstance(preferred_memory, PreferredMemory):
            raise TypeError(f"InferenceRequest: preferred_memory must be a pb_utils.PreferredMemory, "
                            f"got {type(preferred_memory).__name__}")
        self._preferred_memory = preferred_memory

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def requested_output_names(self) -> list[str]:
        return self._requested

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self):
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def is_cancelled(self) -> bool:
        return self._call is not None and _the_host().cancelled(self._call)

    def trace(self) -> InferenceTrace | None:
        return self._trace

    def get_response_sender(self) -> InferenceResponseSender:
        if self._call is None:
            raise TritonModelException("only a request given to execute has a response sender")
        return _the_host().sender(self._call, self._trace._ref[1])

    def set_release_flags(self, flags: int) -> None:
        """TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: run this request again in a later execute (a model whose
        config has `sequence_batching { iterative_sequence: true }`); RELEASE_ALL (the default): it is done."""
        if flags not in (TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE):
            raise TritonModelException(f"set_release_flags: flags must be TRITONSERVER_REQUEST_RELEASE_ALL (1) or "
                                       f"TRITONSERVER_REQUEST_RELEASE_RESCHEDULE (2), got {flags!r}")
        self._release_flags = flags

    def _rescheduled(self) -> bool:
        return self._release_flags == TRITONSERVER_REQUEST_RELEASE_RESCHEDULE

    def exec(self, decoupled: bool = False):
        """Run this request on `model_name` and wait: one InferenceResponse, or (decoupled) an iterator of them."""
        if self._preferred_memory is not None:
            self._preferred_memory._checked()
        return _the_host().call(self, decoupled).result()

    async def async_exec(self, decoupled: bool = False):
        if self._preferred_memory is not None:
            self._preferred_memory._checked()
        return await asyncio.wrap_future(_the_host().call(self, decoupled))


def get_input_tensor_by_name(inference_request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in inference_request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(inference_response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in inference_response.output_tensors() if t.name() == name), None)


def get_input_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: dict, name: str) -> dict | None:
    return next((t for t in model_config.get("output", []) if t["name"] == name), None)


def using_decoupled_model_transaction_policy(model_config: dict) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def load_model(model_name: str, config: str = "", files: dict | None = None) -> None:
    """Triton's: `config` a JSON model config that replaces the folder's; `files` {"file:<path>": bytes}, the
    model folder sent inline (needs `config`). The server checks them as it checks a LoadModel RPC's."""
    if not isinstance(config, str):
        raise TritonModelException(f"load_model: config must be the model config as a JSON string, got {type(config)}")
    if not isinstance(files or {}, dict):
        raise TritonModelException(f"load_model: files must be a dict of 'file:<path>' -> bytes, got {type(files)}")
    sent = {key: bytes(value) if isinstance(value, (bytearray, memoryview)) else value for key, value in (files or {}).items()}
    _the_host().control("load", model_name, "", config, sent)


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    _the_host().control("unload", model_name, "", "", {})


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    return bool(_the_host().control("ready", model_name, str(model_version), "", {}))


from server.backends.python.pb_config import ModelConfig  # noqa: E402 - Triton exposes it here
from server.backends.python.pb_observe import Logger, LogLevel, Metric, MetricFamily  # noqa: E402

__all__ = ["ModelConfig", "Logger", "LogLevel", "Metric", "MetricFamily"]
