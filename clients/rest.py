"""A small blocking client for Ferry's HTTP front door (KServe v2 REST and Triton's generate extension).

It answers the calls the `ferry` commands make (health, models, infer, generate) with the same
results and the same FerryClientError as the gRPC client, so a command works against `--url
http://host:8000` where only the HTTP port is reachable (behind an HTTP-only load balancer or
ingress). Tensors travel with Triton's binary extension both ways, so every datatype, BYTES included,
round-trips exactly. Standard library only: the client installs without an HTTP stack.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc
import numpy as np

from clients import tensors
from clients.errors import FerryClientError
from clients.messages import GenerateDelta, ModelIndex, ModelMetadata, ServerMetadata, TensorSpec, Usage

# Triton's HTTP statuses back to the gRPC codes the gRPC client reports, so callers see one vocabulary.
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
          413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          499: grpc.StatusCode.CANCELLED, 500: grpc.StatusCode.INTERNAL, 501: grpc.StatusCode.UNIMPLEMENTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def is_http_url(url: str) -> bool:
    return url.startswith(("http://", "https://"))


class RestClient:
    """The HTTP counterpart of InferenceClient for the calls the CLI makes. Failures raise FerryClientError."""

    def __init__(self, url: str, *, timeout_s: float | None = None, ssl: bool = False, root_certificates=None,
                 private_key=None, certificate_chain=None, tls_server_name: str | None = None,
                 token: str | None = None, headers: Mapping[str, str] | None = None):
        if tls_server_name:
            raise ValueError("--tls-server-name is for gRPC; over HTTPS the URL's host is verified")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.tls = self.url.startswith("https://") or ssl
        self._context = _ssl_context(root_certificates, private_key, certificate_chain) if self.tls else None
        self._headers = dict(headers or {})
        if token:
            self._headers["Authorization"] = f"Bearer {token}"

    def close(self) -> None:
        """Nothing is held between calls (one connection per call)."""

    def __enter__(self) -> RestClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ transport
    def _open(self, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None):
        request = urllib.request.Request(self.url + path, data=body, method="POST" if body is not None else "GET",
                                         headers={**self._headers, **(headers or {})})
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s, context=self._context)
        except urllib.error.HTTPError as exc:
            raise _error(exc.code, exc.read()) from None
        except (urllib.error.URLError, OSError) as exc:
            raise FerryClientError(grpc.StatusCode.UNAVAILABLE, f"{self.url}: {getattr(exc, 'reason', exc)}") from None

    def _status(self, path: str) -> bool:
        """Triton's probes answer 200 for yes and 400 for no; anything else is an error."""
        try:
            with self._open(path) as answer:
                return answer.status == 200
        except FerryClientError as exc:
            if exc.status == grpc.StatusCode.INVALID_ARGUMENT:
                return False
            raise

    def _json(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        with self._open(path, data, {"Content-Type": "application/json"} if data is not None else None) as answer:
            return json.loads(answer.read())

    # ------------------------------------------------------------ KServe v2
    def is_live(self) -> bool:
        return self._status("/v2/health/live")

    def is_ready(self) -> bool:
        return self._status("/v2/health/ready")

    def is_model_ready(self, model: str, version: str = "") -> bool:
        return self._status(_model_path(model, version) + "/ready")

    def server_metadata(self) -> ServerMetadata:
        meta = self._json("/v2")
        return ServerMetadata(meta["name"], meta["version"], tuple(meta.get("extensions", ())))

    def model_metadata(self, model: str, version: str = "") -> ModelMetadata:
        meta = self._json(_model_path(model, version))

        def specs(items):
            return tuple(TensorSpec(t["name"], t["datatype"], tuple(t["shape"])) for t in items)

        return ModelMetadata(meta["name"], tuple(meta.get("versions", ())), meta.get("platform", ""),
                             specs(meta.get("inputs", ())), specs(meta.get("outputs", ())))

    def repository_index(self, ready_only: bool = False) -> list[ModelIndex]:
        rows = self._json("/v2/repository/index", {"ready": ready_only})
        return [ModelIndex(r["name"], r.get("version", ""), r.get("state", ""), r.get("reason", "")) for r in rows]

    def infer(self, model: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str] | None = None, *,
              version: str = "") -> dict[str, np.ndarray]:
        """One request, every tensor in Triton's binary extension (a JSON header, then the raw bytes)."""
        specs, raws = [], []
        for name, value in inputs.items():
            array = np.asarray(value)
            datatype, raw = tensors.to_raw(array)
            specs.append({"name": name, "datatype": datatype, "shape": list(array.shape),
                          "parameters": {"binary_data_size": len(raw)}})
            raws.append(raw)
        header: dict = {"inputs": specs}
        if outputs:
            header["outputs"] = [{"name": n, "parameters": {"binary_data": True}} for n in outputs]
        else:
            header["parameters"] = {"binary_data_output": True}
        head = json.dumps(header).encode()
        with self._open(_model_path(model, version) + "/infer", head + b"".join(raws),
                        {"Content-Type": "application/octet-stream",
                         "Inference-Header-Content-Length": str(len(head))}) as answer:
            length = answer.headers.get("Inference-Header-Content-Length")
            return _infer_outputs(answer.read(), int(length) if length else None)

    # ------------------------------------------------------------ generation (Triton's generate extension)
    def generate(self, model: str, prompt: str, *, version: str = "", **sampling) -> Iterator[GenerateDelta]:
        """Stream deltas from /generate_stream (server-sent events); greedy unless `temperature` is given,
        as over gRPC. The last delta carries finish_reason and usage; HTTP sends no token ids or timings."""
        if not isinstance(prompt, str):
            raise ValueError("over HTTP the prompt is text (token ids need gRPC or /v1/completions)")
        body = json.dumps({"text_input": prompt, "parameters": sampling}).encode()
        answer = self._open(_model_path(model, version) + "/generate_stream", body, {"Content-Type": "application/json"})
        with answer:
            for line in answer:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise FerryClientError(grpc.StatusCode.INTERNAL, str(event["error"]))
                usage = event.get("usage")
                yield GenerateDelta(event.get("text_output", ""), (), event.get("finish_reason") or "",
                                    usage and Usage(usage["prompt_tokens"], usage["completion_tokens"]))


def _model_path(model: str, version: str) -> str:
    path = "/v2/models/" + urllib.parse.quote(model, safe="")
    return path + (f"/versions/{urllib.parse.quote(version, safe='')}" if version else "")


def _infer_outputs(data: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    header = json.loads(data[:header_length] if header_length is not None else data)
    offset, result = header_length or 0, {}
    for out in header.get("outputs", ()):
        shape = tuple(out["shape"])
        size = (out.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            result[out["name"]] = tensors.from_raw(out["datatype"], shape, data[offset:offset + size])
            offset += size
        elif out["datatype"] == "BYTES":
            result[out["name"]] = np.array([s.encode() for s in np.ravel(out["data"])], dtype=object).reshape(shape)
        else:
            result[out["name"]] = np.array(out["data"], dtype=tensors.BY_API[out["datatype"]]).reshape(shape)
    return result


def _error(status: int, body: bytes) -> FerryClientError:
    try:
        message = json.loads(body)["error"]
        message = message.get("message", message) if isinstance(message, dict) else message  # OpenAI's shape
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    return FerryClientError(_CODES.get(status, grpc.StatusCode.UNKNOWN), str(message))


def _ssl_context(root_certificates, private_key, certificate_chain) -> ssl.SSLContext:
    """The system's trust store, or the given root certificates; a client certificate when both parts are given."""
    context = ssl.create_default_context()
    if root_certificates:
        pem = root_certificates if isinstance(root_certificates, bytes) else Path(root_certificates).read_bytes()
        context.load_verify_locations(cadata=pem.decode())
    if certificate_chain and private_key:
        if isinstance(certificate_chain, bytes) or isinstance(private_key, bytes):
            raise ValueError("over HTTPS give the client certificate and key as files")
        context.load_cert_chain(str(certificate_chain), str(private_key))
    return context
