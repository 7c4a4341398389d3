"""The asyncio client: InferenceClient's calls as coroutines, generation as an async iterator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence

import grpc
import numpy as np

from clients import messages
from clients.client import ClientBase
from clients.connection import open_channel
from clients.errors import FerryClientError
from clients.messages import GenerateDelta, ModelIndex, ModelMetadata, ServerMetadata
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from protos import model_config_pb2


class AsyncInferenceClient(ClientBase):
    """asyncio client (grpc.aio); create it inside the event loop that uses it."""

    def __init__(self, url: str = "127.0.0.1:8001", **options):
        super().__init__(url, **options)
        self.channel = open_channel(url, self.tls, asynchronous=True)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self._generation = gen_grpc.GenerationStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, rpc: str, request, timeout_s: float | None):
        try:
            return await getattr(self._stub, rpc)(request, timeout=self._deadline(timeout_s), metadata=self.metadata)
        except grpc.RpcError as exc:
            raise FerryClientError.from_rpc(exc) from None

    async def is_live(self, timeout_s: float | None = None) -> bool:
        return (await self._call("ServerLive", pb.ServerLiveRequest(), timeout_s)).live

    async def is_ready(self, timeout_s: float | None = None) -> bool:
        return (await self._call("ServerReady", pb.ServerReadyRequest(), timeout_s)).ready

    async def is_model_ready(self, model: str, version: str = "", timeout_s: float | None = None) -> bool:
        return (await self._call("ModelReady", pb.ModelReadyRequest(name=model, version=version), timeout_s)).ready

    async def server_metadata(self, timeout_s: float | None = None) -> ServerMetadata:
        return messages.server_metadata(await self._call("ServerMetadata", pb.ServerMetadataRequest(), timeout_s))

    async def model_metadata(self, model: str, version: str = "", timeout_s: float | None = None) -> ModelMetadata:
        response = await self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version), timeout_s)
        return messages.model_metadata(response)

    async def model_config(self, model: str, version: str = "",
                           timeout_s: float | None = None) -> model_config_pb2.ModelConfig:
        return (await self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version), timeout_s)).config

    async def model_statistics(self, model: str = "", version: str = "",
                               timeout_s: float | None = None) -> list[pb.ModelStatistics]:
        request = pb.ModelStatisticsRequest(name=model, version=version)
        return list((await self._call("ModelStatistics", request, timeout_s)).model_stats)

    async def repository_index(self, ready_only: bool = False, timeout_s: float | None = None) -> list[ModelIndex]:
        response = await self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready_only), timeout_s)
        return messages.repository_index(response)

    async def load_model(self, model: str, timeout_s: float | None = None) -> None:
        await self._call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=model), timeout_s)

    async def unload_model(self, model: str, timeout_s: float | None = None) -> None:
        await self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model), timeout_s)

    async def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, *,
                    version: str = "", request_id: str = "", parameters: Mapping | None = None,
                    timeout_s: float | None = None) -> dict[str, np.ndarray]:
        request = messages.infer_request(model, inputs, outputs, version, request_id, parameters)
        return messages.infer_outputs(await self._call("ModelInfer", request, timeout_s))

    def generate(self, model: str, prompt: str | Sequence[int], *, version: str = "", request_id: str = "",
                 priority: int = 0, timeout_s: float | None = None, **sampling) -> AsyncIterator[GenerateDelta]:
        """`async for delta in client.generate(...)`; see InferenceClient.generate."""
        request = messages.generate_request(model, prompt, version, request_id, priority, **sampling)
        return _deltas(self._generation.Generate, request, self._deadline(timeout_s), self.metadata)


async def _deltas(rpc, request, timeout_s: float | None, metadata=None) -> AsyncIterator[GenerateDelta]:
    call = rpc(request, timeout=timeout_s, metadata=metadata)
    try:
        async for response in call:
            yield messages.generate_delta(response)
    except grpc.RpcError as exc:
        raise FerryClientError.from_rpc(exc) from None
    finally:
        call.cancel()
