"""What a stateful model receives besides the client's tensors: control inputs and implicit state.

Built once from `sequence_batching`: the control tensors (START, END, READY, CORRID) with the model's
own false/true values and data type, and the state tensors the server carries from one request of a
sequence to the next (`state { input_name output_name ... }`, zeros at START). Config mistakes are
refused at load, naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from protos import model_config_pb2 as mc
from server.tensors import datatypes
from server.errors import InvalidInputError
from server.repository.config import field_error
from server.tensors.signature import Signature, TensorSpec

Control = mc.ModelSequenceBatching.Control
START, READY, END, CORRID = (Control.CONTROL_SEQUENCE_START, Control.CONTROL_SEQUENCE_READY,
                             Control.CONTROL_SEQUENCE_END, Control.CONTROL_SEQUENCE_CORRID)
FLAG_START, FLAG_END = 1, 2  # Triton's request flags, as a model sees them (TRITONSERVER_REQUEST_FLAG_SEQUENCE_*)


@dataclass(frozen=True, slots=True)
class ControlTensor:
    name: str
    kind: int
    dtype: datatypes.DataType
    false_true: tuple = (0, 1)


@dataclass(frozen=True, slots=True)
class StateTensor:
    input_name: str
    output_name: str
    dtype: datatypes.DataType
    dims: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SequenceInputs:
    controls: tuple[ControlTensor, ...]
    states: tuple[StateTensor, ...]
    batching: bool  # the model has a batch dimension: every tensor gets a leading 1

    @classmethod
    def from_config(cls, config: mc.ModelConfig, source: str) -> SequenceInputs:
        sb = config.sequence_batching
        controls = tuple(_control(ci, c, source) for ci in sb.control_input for c in ci.control)
        states = tuple(_state(i, s, source) for i, s in enumerate(sb.state))
        return cls(controls, states, config.max_batch_size > 0)

    def worker_signature(self, signature: Signature) -> Signature:
        """The model's signature as its instances see it: client tensors plus controls and state."""
        inputs = dict(signature.inputs)
        outputs = dict(signature.outputs)
        for c in self.controls:
            inputs[c.name] = TensorSpec(c.name, c.dtype, (1,))
        for s in self.states:
            inputs[s.input_name] = TensorSpec(s.input_name, s.dtype, s.dims)
            outputs[s.output_name] = TensorSpec(s.output_name, s.dtype, s.dims)
        return dataclasses.replace(signature, inputs=inputs, outputs=outputs)

    def tensors(self, cid, start: bool, end: bool, state: dict | None) -> dict[str, np.ndarray]:
        """The inputs the server adds to one request of sequence `cid` (state None: start from zeros)."""
        lead = (1,) if self.batching else ()
        flags = {START: start, END: end, READY: True}
        added = {}
        for c in self.controls:
            value = cid if c.kind == CORRID else c.false_true[int(flags[c.kind])]
            added[c.name] = np.array([value], dtype=c.dtype.numpy if c.dtype.api != "BYTES" else object).reshape(lead + (1,))
        for s in self.states:
            carried = None if state is None else state.get(s.output_name)
            added[s.input_name] = carried if carried is not None else np.zeros(lead + s.dims, s.dtype.numpy)
        return added

    def carried(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state outputs of a request, copied: they become the next request's state inputs."""
        return {s.output_name: np.array(outputs[s.output_name]) for s in self.states}

    def visible(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        hidden = {s.output_name for s in self.states}
        return {k: v for k, v in outputs.items() if k not in hidden}


def _control(ci, control, source: str) -> ControlTensor:
    where = f"sequence_batching.control_input '{ci.name}'"
    if control.kind == CORRID:
        if control.data_type not in (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING):
            raise field_error(source, where, "CORRID needs data_type TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 or TYPE_STRING")
        return ControlTensor(ci.name, CORRID, datatypes.BY_CONFIG[mc.DataType.Name(control.data_type)])
    for values, dtype in ((control.int32_false_true, "TYPE_INT32"), (control.fp32_false_true, "TYPE_FP32"),
                          (control.bool_false_true, "TYPE_BOOL")):
        if values:
            if len(values) != 2:
                raise field_error(source, where, f"needs exactly two values (false, true), got {list(values)}")
            return ControlTensor(ci.name, control.kind, datatypes.BY_CONFIG[dtype], tuple(values))
    raise field_error(source, where, "sets none of int32_false_true, fp32_false_true, bool_false_true")


def _state(i: int, state, source: str) -> StateTensor:
    where = f"sequence_batching.state[{i}]"
    if not state.input_name or not state.output_name:
        raise field_error(source, where, "needs input_name and output_name")
    if not state.dims or any(d < 1 for d in state.dims):
        raise field_error(source, f"{where}.dims", f"must be fixed positive sizes, got {list(state.dims)}")
    if state.data_type in (mc.TYPE_INVALID, mc.TYPE_STRING, mc.TYPE_BF16):
        raise field_error(source, f"{where}.data_type", "must be a numeric TYPE_*")
    return StateTensor(state.input_name, state.output_name, datatypes.BY_CONFIG[mc.DataType.Name(state.data_type)],
                       tuple(state.dims))


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    cid: object  # int (uint64) or str
    start: bool
    end: bool


def sequence_flags(parameters: dict, model: str) -> SequenceFlags:
    """Read tritonclient's `sequence_id`, `sequence_start`, `sequence_end` request parameters."""
    cid = parameters.pop("sequence_id", None)
    start, end = parameters.pop("sequence_start", False), parameters.pop("sequence_end", False)
    if isinstance(cid, bool) or not isinstance(cid, (int, str)) or cid in (0, ""):
        raise InvalidInputError(f"inference request to model '{model}' must specify a non-zero or non-empty "
                                "correlation ID (parameter 'sequence_id')")
    if isinstance(cid, int) and not 0 < cid < 2**64:
        raise InvalidInputError(f"parameter 'sequence_id' must fit in uint64, got {cid}")
    if not isinstance(start, bool) or not isinstance(end, bool):
        raise InvalidInputError("parameters 'sequence_start' and 'sequence_end' must be booleans")
    return SequenceFlags(cid, start, end)
