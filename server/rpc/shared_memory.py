"""The SystemSharedMemory* and CudaSharedMemory* RPCs: protobuf <-> server/shared_memory.py.

A mixin of InferenceServicer (which sets `self.shared_memory`); the registry does every check and
says every error, these handlers only translate. CUDA shared memory (CUDA IPC handles) is not
implemented: its RPCs say so and point at system shared memory, never grpc's placeholder text.
"""

from __future__ import annotations

from pathlib import Path

from protos import grpc_service_pb2 as pb
from server.errors import UnsupportedError
from server.rpc import codec
from server.rpc.errors import translate_errors
from server.shared_memory import BYTE_SIZE, OFFSET, REGION, Placement, SharedMemoryRegistry, placement

CUDA_REFUSED = ("{rpc}: CUDA shared memory is not implemented by Ferry ({device}); use system shared memory "
                "(SystemSharedMemoryRegister) or send the tensors in the request")


def _cuda_refused(rpc: str) -> UnsupportedError:
    gpus = Path("/proc/driver/nvidia/gpus")
    device = ("this server has a CUDA device but does not open CUDA IPC handles" if gpus.is_dir() and any(gpus.iterdir())
              else "no CUDA device is present on this server")
    return UnsupportedError(CUDA_REFUSED.format(rpc=rpc, device=device))


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
        raise _cuda_refused("CudaSharedMemoryRegister")

    @translate_errors
    async def CudaSharedMemoryStatus(self, request, context):
        raise _cuda_refused("CudaSharedMemoryStatus")

    @translate_errors
    async def CudaSharedMemoryUnregister(self, request, context):
        raise _cuda_refused("CudaSharedMemoryUnregister")


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


def output_targets(registry: SharedMemoryRegistry, request) -> dict:
    """Requested outputs that name a region -> (Region, Placement), checked before any work."""
    return registry.targets([p for p in map(_placement, request.outputs) if p is not None])
