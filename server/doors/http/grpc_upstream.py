"""The HTTP API's requests answered by a running Ferry server's gRPC door (`ferry batch --url grpc://HOST:PORT`).

A request (path and JSON body, as POSTed to the HTTP door) is read by the HTTP door's own readers, sent
as the gRPC call that serves the same thing (ModelInfer for /infer, Generate for /generate and the
OpenAI paths: grpc_generation.py), and the answer is written by the HTTP door's own encoders
(tensors.encode_infer, openai_api.Reply, generate.answer). A gRPC status becomes the domain error it
was made from (the inverse of the gRPC door's one table), answered with the HTTP door's status and
error body, so an answer reads as the HTTP API's own.

What cannot travel over gRPC is named by `problem` for a caller to refuse up front: /generate for a
model that takes tensors by name (only a string `text_input` reaches Generate), chat messages with
fields other than role and content, sampling integers past the message's field widths.
"""

from __future__ import annotations

import re

import grpc
from starlette.responses import JSONResponse

from protos import generate_pb2_grpc as gen_grpc
from protos import grpc_service_pb2 as pb
from protos import grpc_service_pb2_grpc as pb_grpc
from server import errors
from server.doors.grpc import codec
from server.doors.grpc.errors import STATUS
from server.doors.http import grpc_generation as generation
from server.doors.http import tensors
from server.doors.http.errors import kserve_error, message_of, openai_error, status_of
from server.tensors import datatypes, wire
from server.tensors.shared_memory import SharedMemoryRegistry

_MODEL_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[0-9]+))?/(?P<verb>infer|generate)")
_ERROR_OF = {}
for _cls, _code in STATUS.items():  # first wins: each code's classes share one HTTP status
    _ERROR_OF.setdefault(_code, _cls)
_NOT_ANSWERS = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.CANCELLED}
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


class NoAnswer(Exception):
    """The server gave no answer to this request (a refused token, a cancelled call, our own timeout)."""


def problem(url: str, body: dict) -> str | None:
    """Why this request cannot be sent over gRPC, or None when it can (bad bodies can: they get their 4xx)."""
    if url in ("/v1/chat/completions", "/v1/completions"):
        return generation.openai_problem(body, chat=url == "/v1/chat/completions")
    if url == "/v1/embeddings":
        return "/v1/embeddings lines are not sent over gRPC; run them locally or with --url http://HOST:PORT"
    match = _MODEL_PATH.fullmatch(url)
    if match is not None and match["verb"] == "generate":
        return generation.generate_problem(body)
    return None


class GrpcUpstream:
    """`async with GrpcUpstream("HOST:PORT") as up: status, body, media_type = await up.post(path, body)`."""

    def __init__(self, target: str, token: str | None = None, timeout_s: float | None = None, secure: bool = False):
        self.target, self.secure, self.timeout_s = target, secure, timeout_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.channel = None

    async def __aenter__(self) -> GrpcUpstream:
        self.channel = (grpc.aio.secure_channel(self.target, grpc.ssl_channel_credentials(), options=_UNLIMITED)
                        if self.secure else grpc.aio.insecure_channel(self.target, options=_UNLIMITED))
        self.inference = pb_grpc.GRPCInferenceServiceStub(self.channel)
        self.generator = generation.Generator(gen_grpc.GenerationStub(self.channel), self.failure, self.call_options)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.channel.close()

    def call_options(self) -> dict:
        return {"timeout": self.timeout_s, "metadata": self.metadata}

    async def post(self, path: str, body: bytes) -> tuple[int, bytes, str]:
        """The status, body and content type the HTTP API answers for this request; raises NoAnswer when there
        is none."""
        openai = path in ("/v1/chat/completions", "/v1/completions")
        try:
            if openai:
                return _json(await generation.openai_answer(self.generator, body, chat=path == "/v1/chat/completions"))
            match = _MODEL_PATH.fullmatch(path)
            if match is None:
                raise errors.UnsupportedError(f"{path} has no gRPC equivalent")
            if match["verb"] == "generate":
                return _json(await generation.generate_answer(self.generator, match["name"], match["version"] or "", body))
            return await self._infer(match["name"], match["version"] or "", body)
        except NoAnswer:
            raise
        except Exception as exc:  # noqa: BLE001 - answered with the HTTP door's error body, as the door does
            answer = (openai_error if openai else kserve_error)(status_of(exc), message_of(exc))
            return answer.status_code, answer.body, answer.media_type

    async def _infer(self, name: str, version: str, body: bytes) -> tuple[int, bytes, str]:
        header, binary = tensors.split_body(body, None)
        regions = SharedMemoryRegistry()  # what this process has registered: none, as ferry batch's own door
        decoded = tensors.decode_infer(header, binary, regions)
        regions.targets(decoded.placements)
        request = pb.ModelInferRequest(model_name=name, model_version=version, id=decoded.id)
        for input_name, array in decoded.inputs.items():
            request.inputs.add(name=input_name, datatype=datatypes.from_numpy(array.dtype).api, shape=array.shape)
            request.raw_input_contents.append(wire.to_raw(array))
        classes = dict(decoded.classes)
        for output_name in decoded.requested:
            wanted = request.outputs.add(name=output_name)
            if output_name in classes:  # the server answers it as classes, as it would over HTTP
                _set_parameter(wanted.parameters["classification"], "classification", classes[output_name]["classification"])
        for key, value in decoded.parameters.items():
            _set_parameter(request.parameters[key], key, value)
        try:
            response = await self.inference.ModelInfer(request, **self.call_options())
        except grpc.aio.AioRpcError as err:
            raise self.failure(err) from None
        outputs = {t.name: wire.from_raw(t.name, datatypes.BY_API[t.datatype], tuple(t.shape), raw)
                   for t, raw in zip(response.outputs, response.raw_output_contents)}
        data, header_length = tensors.encode_infer(decoded, response.model_name, response.model_version, outputs,
                                                   tuple(t.name for t in response.outputs))
        return 200, data, "application/json" if header_length is None else "application/octet-stream"

    def failure(self, err: grpc.aio.AioRpcError) -> Exception:
        """The domain error a gRPC status was made from, or NoAnswer when the status is no answer at all."""
        code = err.code()
        if code in _NOT_ANSWERS or (code == grpc.StatusCode.DEADLINE_EXCEEDED and self.timeout_s is not None):
            return NoAnswer(f"{code.name}: {err.details()}")
        return _ERROR_OF.get(code, errors.BackendError)(err.details() or code.name)


def _json(content: dict) -> tuple[int, bytes, str]:
    response = JSONResponse(content)
    return response.status_code, response.body, response.media_type


def _set_parameter(param: pb.InferParameter, key: str, value) -> None:
    if not isinstance(value, (bool, int, float, str)):
        raise errors.InvalidInputError(f"parameter '{key}' must be a boolean, number or string")
    codec.set_parameter(param, value)
