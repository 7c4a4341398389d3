"""Triton's shared-memory extensions over HTTP: /v2/systemsharedmemory/... and /v2/cudasharedmemory/....

The same operations as the gRPC RPCs (rpc/shared_memory.py), translated from URLs and JSON:
server/tensors/shared_memory.py owns the system regions and says every error, server/tensors/cuda_shared_memory.py
answers for CUDA regions (none). Status bodies are Triton's: a JSON list of regions.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server.tensors import cuda_shared_memory as cuda
from server.errors import DisabledError, InvalidInputError
from server.names import capped, shown
from server.tensors.shared_memory import REGISTER_REFUSED, SharedMemoryRegistry
from server.doors.http.body import read_body
from server.doors.http.kserve import kserve_errors
from server.doors.http.tensors import parse_json

SYSTEM, CUDA = "/v2/systemsharedmemory", "/v2/cudasharedmemory"


class SharedMemoryRoutes:
    def __init__(self, regions: SharedMemoryRegistry, body_limit: int):
        self.regions, self.body_limit = regions, body_limit

    def routes(self) -> list[Route]:
        table = []
        for base, status, register, unregister in (
                (SYSTEM, self.system_status, self.system_register, self.system_unregister),
                (CUDA, self.cuda_status, self.cuda_register, self.cuda_unregister)):
            table += [Route(f"{base}/status", status, methods=["GET"]),
                      Route(f"{base}/region/{{name}}/status", status, methods=["GET"]),
                      Route(f"{base}/region/{{name}}/register", register, methods=["POST"]),
                      Route(f"{base}/unregister", unregister, methods=["POST"]),
                      Route(f"{base}/region/{{name}}/unregister", unregister, methods=["POST"])]
        return table

    @kserve_errors
    async def system_status(self, request: Request) -> Response:
        return JSONResponse([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                             for r in self.regions.status(_name(request))])

    @kserve_errors
    async def system_register(self, request: Request) -> Response:
        body = await self._object(request)
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        if not isinstance(key, str):
            raise InvalidInputError(f"registering shared memory region {shown(_name(request))} needs a string 'key'")
        for field, value in (("offset", offset), ("byte_size", size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInputError(f"registering shared memory region {shown(_name(request))}: '{field}' must be a "
                                        f"non-negative integer, got {capped(repr(value), 60)}")
        self.regions.register(_name(request), key, offset, size)
        return Response(status_code=200)

    @kserve_errors
    async def system_unregister(self, request: Request) -> Response:
        self.regions.unregister(_name(request))
        return Response(status_code=200)

    @kserve_errors
    async def cuda_status(self, request: Request) -> Response:
        return JSONResponse(cuda.status(_name(request)))

    @kserve_errors
    async def cuda_register(self, request: Request) -> Response:
        if not self.regions.allow_register:  # said first, as Triton does
            raise DisabledError(REGISTER_REFUSED)
        body = await self._object(request)
        handle, device_id, size = body.get("raw_handle"), body.get("device_id", 0), body.get("byte_size")
        if not isinstance(handle, dict) or not isinstance(handle.get("b64"), str):  # tritonclient.http: {"b64": text}
            raise InvalidInputError(f"registering CUDA shared memory region {shown(_name(request))} needs 'raw_handle': "
                                    '{"b64": the base64 text of a CUDA IPC handle}')
        for field, value in (("device_id", device_id), ("byte_size", size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidInputError(f"registering CUDA shared memory region {shown(_name(request))}: '{field}' must be "
                                        f"an integer, got {capped(repr(value), 60)}")
        cuda.register(f"POST {CUDA}/region/{_name(request)}/register", f"POST {SYSTEM}/region/{_name(request)}/register",
                      _name(request), device_id, size, self.regions.allow_register)

    @kserve_errors
    async def cuda_unregister(self, request: Request) -> Response:
        cuda.unregister(_name(request))
        return Response(status_code=200)

    async def _object(self, request: Request) -> dict:
        body = parse_json(await read_body(request, self.body_limit) or b"{}")
        if not isinstance(body, dict):
            raise InvalidInputError(f"the request body must be a JSON object, got {type(body).__name__}")
        return body


def _name(request: Request) -> str:
    return request.path_params.get("name", "")
