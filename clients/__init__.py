"""Ferry clients: the Python client library (blocking and asyncio), the `ferry` subcommands and `ferry perf`."""

from clients.aio import AsyncInferenceClient
from clients.client import InferenceClient
from clients.connection import TlsOptions
from clients.errors import FerryClientError
from clients.messages import GenerateDelta, ModelIndex, ModelMetadata, ServerMetadata, TensorSpec, Timings, Usage

__all__ = [
    "AsyncInferenceClient", "FerryClientError", "GenerateDelta", "InferenceClient", "ModelIndex", "ModelMetadata",
    "ServerMetadata", "TensorSpec", "Timings", "TlsOptions", "Usage",
]
