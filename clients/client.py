"""The blocking Python client: every KServe v2 RPC Ferry serves, plus streaming generation."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import grpc
import numpy as np

from clients import messages
from clients.connection import Pem, open_channel, tls_options
from clients.errors import FerryClientError
from clients.messages import GenerateDelta, ModelIndex, ModelMetadata, ServerMetadata
from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from protos import model_config_pb2


class ClientBase:
    """What both clients share: the channel's settings and the default deadline."""

    def __init__(self, url: str = "127.0.0.1:8001", *, timeout_s: float | None = None, ssl: bool = False,
                 root_certificates: Pem | None = None, private_key: Pem | None = None,
                 certificate_chain: Pem | None = None, tls_server_name: str | None = None,
                 token: str | None = None, headers: Mapping[str, str] | None = None):
        """`timeout_s` is every call's deadline unless the call gives its own (None: no deadline).
        Any certificate option implies TLS; `ssl=True` alone uses the system's trust store.
        `token` is sent as `authorization: Bearer <token>`; `headers` are sent as metadata on every call."""
        self.url = url
        self.timeout_s = timeout_s
        self.tls = tls_options(ssl, root_certificates, private_key, certificate_chain, tls_server_name)
        pairs = {k.lower(): v for k, v in (headers or {}).items()}
        if token:
            pairs["authorization"] = f"Bearer {token}"
        self.metadata = tuple(pairs.items()) or None

    def _deadline(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s


class InferenceClient(ClientBase):
    """Blocking client. Every failed call raises FerryClientError(status, message)."""

    def __init__(self, url: str = "127.0.0.1:8001", **options):
        super().__init__(url, **options)
        self.channel = open_channel(url, self.tls)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self._generation = gen_grpc.GenerationStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, rpc: str, request, timeout_s: float | None):
        try:
            return getattr(self._stub, rpc)(request, timeout=self._deadline(timeout_s), metadata=self.metadata)
        except grpc.RpcError as exc:
            raise FerryClientError.from_rpc(exc) from None

    def is_live(self, timeout_s: float | None = None) -> bool:
        return self._call("ServerLive", pb.ServerLiveRequest(), timeout_s).live

    def is_ready(self, timeout_s: float | None = None) -> bool:
        return self._call("ServerReady", pb.ServerReadyRequest(), timeout_s).ready

    def is_model_ready(self, model: str, version: str = "", timeout_s: float | None = None) -> bool:
        return self._call("ModelReady", pb.ModelReadyRequest(name=model, version=version), timeout_s).ready

    def server_metadata(self, timeout_s: float | None = None) -> ServerMetadata:
        return messages.server_metadata(self._call("ServerMetadata", pb.ServerMetadataRequest(), timeout_s))

    def model_metadata(self, model: str, version: str = "", timeout_s: float | None = None) -> ModelMetadata:
        response = self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version), timeout_s)
        return messages.model_metadata(response)

    def model_config(self, model: str, version: str = "",
                     timeout_s: float | None = None) -> model_config_pb2.ModelConfig:
        """The completed config as the server runs it (protobuf; `json_format.MessageToDict` for a dict)."""
        return self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version), timeout_s).config

    def model_statistics(self, model: str = "", version: str = "",
                         timeout_s: float | None = None) -> list[pb.ModelStatistics]:
        """Triton's per-version statistics; an empty model name means every model."""
        request = pb.ModelStatisticsRequest(name=model, version=version)
        return list(self._call("ModelStatistics", request, timeout_s).model_stats)

    def repository_index(self, ready_only: bool = False, timeout_s: float | None = None) -> list[ModelIndex]:
        response = self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready_only), timeout_s)
        return messages.repository_index(response)

    def load_model(self, model: str, timeout_s: float | None = None, config: str | None = None) -> None:
        """Load or reload `model`; `config` (a JSON ModelConfig, Triton's load parameter) replaces its folder's
        config. A reload that fails leaves the versions already serving in place."""
        parameters = {"config": pb.ModelRepositoryParameter(string_param=config)} if config is not None else None
        self._call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=model, parameters=parameters), timeout_s)

    def unload_model(self, model: str, timeout_s: float | None = None) -> None:
        self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model), timeout_s)

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, *,
              version: str = "", request_id: str = "", parameters: Mapping | None = None,
              timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """Run one request; `outputs` picks a subset (default: all). Tensors travel as raw bytes."""
        request = messages.infer_request(model, inputs, outputs, version, request_id, parameters)
        return messages.infer_outputs(self._call("ModelInfer", request, timeout_s))

    def generate(self, model: str, prompt: str | Sequence[int], *, version: str = "", request_id: str = "",
                 priority: int = 0, timeout_s: float | None = None, **sampling) -> Iterator[GenerateDelta]:
        """Stream deltas as the server produces them; the last carries finish_reason, usage and timings.
        `sampling`: max_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, ignore_eos.
        Leaving the loop early cancels the request on the server."""
        request = messages.generate_request(model, prompt, version, request_id, priority, **sampling)
        return _deltas(self._generation.Generate, request, self._deadline(timeout_s), self.metadata)


def _deltas(rpc, request, timeout_s: float | None, metadata=None) -> Iterator[GenerateDelta]:
    call = rpc(request, timeout=timeout_s, metadata=metadata)  # on the first next(), so an unused stream never starts
    try:
        for response in call:
            yield messages.generate_delta(response)
    except grpc.RpcError as exc:
        raise FerryClientError.from_rpc(exc) from None
    finally:
        call.cancel()  # a no-op once the stream has ended
