"""The SystemSharedMemory* and CudaSharedMemory* RPCs: protobuf <-> server/tensors/shared_memory.py.

A mixin of InferenceServicer (which sets `self.shared_memory`); the registry does every check and
says every error, these handlers only translate. CUDA shared memory (server/tensors/cuda_shared_memory.py)
holds no regions: status and unregister answer as for an empty set, register says what to use instead.
"""

from __future__ import annotations

from protos import grpc_service_pb2 as pb
from server.tensors import cuda_shared_memory as cuda
from server.doors.grpc import codec
from server.doors.grpc.errors import translate_errors
from server.tensors.shared_memory import BYTE_SIZE, OFFSET, REGION, Placement, SharedMemoryRegistry, placement

class SharedMemoryRpcs:
    shared_memory: SharedMemoryRegistry

    @translate_errors
    async def SystemSharedMemoryRegister(self, request, context):
        self.shared_memory.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @translate_errors
    async def SystemSharedMemoryStatus(self, request, context):
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        return pb.SystemSharedMemoryStatusResponse(regions={
            r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size)
            for r in self.shared_memory.status(request.name)})

    @translate_errors
    async def SystemSharedMemoryUnregister(self, request, context):
        self.shared_memory.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @translate_errors
    async def CudaSharedMemoryRegister(self, request, context):
        cuda.register("CudaSharedMemoryRegister", "SystemSharedMemoryRegister", request.name,
                      request.device_id, request.byte_size, self.shared_memory.allow_register)

    @translate_errors
    async def CudaSharedMemoryStatus(self, request, context):
        cuda.status(request.name)
        return pb.CudaSharedMemoryStatusResponse()

    @translate_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        cuda.unregister(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()


def _placement(tensor) -> Placement | None:
    params = tensor.parameters
    if not params or not (REGION in params or OFFSET in params or BYTE_SIZE in params):  # most tensors: none
        return None
    return placement(tensor.name, codec.decode_parameters(params))


def input_reader(registry: SharedMemoryRegistry):
    """For codec.decode_inputs: an input's array copied out of the region it names, or None."""

    def read(tensor, dtype, shape):
        where = _placement(tensor)
        return None if where is None else registry.read(where, dtype, shape)

    return read


def region_names(request) -> list[str]:
    """The regions a ModelInferRequest's inputs and requested outputs name (checked valid by its decode)."""
    return [t.parameters[REGION].string_param for t in (*request.inputs, *request.outputs)
            if t.parameters and REGION in t.parameters]


def output_targets(registry: SharedMemoryRegistry, outputs) -> dict:
    """Requested outputs (a request's `outputs`) that name a region -> (Region, Placement), checked before any work."""
    if not outputs:  # most requests ask for every output, none of them into a region
        return {}
    return registry.targets([p for p in map(_placement, outputs) if p is not None])
