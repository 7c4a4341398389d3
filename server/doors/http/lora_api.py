"""LoRA adapters on the OpenAI API: addressed by `model`, listed by /v1/models, loaded and unloaded at run time.

An adapter belongs to one generation model (the runner's engine holds it: backends/llm/lora.py); the
OpenAI API names it as a model of its own, as vLLM does. `resolve` finds the model serving a name: a
model of that name first, else the generation model with an adapter of that name. vLLM's
`POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and `POST /v1/unload_lora_adapter`
{"lora_name"} change what is served, so they follow the model control mode's rules (explicit mode only,
the admin token where tokens are set: server/doors/access.py); with several generation models loaded,
`base_model` says which one an adapter is for.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from server.doors.http.body import read_body
from server.doors.http.errors import openai_error, message_of, status_of
from server.doors.http.tensors import parse_json
from server.doors.model_control import CONTROL_REFUSED, ModelControl
from server.doors.shared import serving
from server.errors import AlreadyExistsError, InvalidInputError, ModelNotFoundError, ModelUnavailableError
from server.repository.registry import ModelVersion, Registry
from server.runners.base import GENERATE

PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def _generation_models(registry: Registry) -> list[ModelVersion]:
    return [mv for mv in registry.all_versions() if mv.ready and mv.runner is not None and mv.runner.serves == GENERATE]


def resolve(registry: Registry, name: str) -> tuple[ModelVersion, str]:
    """(the model version serving `name`, the adapter's name or "" for the model itself)."""
    try:
        return serving(registry, name, "", GENERATE), ""
    except ModelNotFoundError:
        for mv in _generation_models(registry):
            if name in mv.runner.adapter_names():
                return mv, name
        raise


def adapter_entries(registry: Registry) -> list[dict]:
    """/v1/models' rows for the adapters, each naming its model as `parent` (vLLM's shape)."""
    latest = {}
    for mv in _generation_models(registry):
        latest[mv.name] = mv  # all_versions is sorted by version: the last is the newest
    return [{"id": name, "object": "model", "created": 0, "owned_by": "ferry", "root": name, "parent": mv.name}
            for mv in latest.values() for name in mv.runner.adapter_names()]


class LoraRoutes:
    def __init__(self, registry: Registry, body_limit: int, control: ModelControl):
        self.registry, self.body_limit, self.control = registry, body_limit, control

    def routes(self) -> list[Route]:
        return [Route(PATHS[0], self.load, methods=["POST"]), Route(PATHS[1], self.unload, methods=["POST"])]

    async def load(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            name, path = _text(body, "lora_name"), _text(body, "lora_path")
            if any(name in (mv.name, *mv.runner.adapter_names()) for mv in _generation_models(self.registry)):
                raise AlreadyExistsError(f"The lora adapter '{name}' has already been loaded (or names a model)")
            await self._base(body).runner.load_adapter(name, path)
        except Exception as exc:  # noqa: BLE001 - answered with its status; message_of logs the unexpected ones
            return openai_error(status_of(exc), message_of(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            name = _text(body, "lora_name")
            owners = [mv for mv in _generation_models(self.registry) if name in mv.runner.adapter_names()]
            if not owners:
                raise ModelNotFoundError(f"The lora adapter '{name}' cannot be found")
            for mv in owners:
                mv.runner.unload_adapter(name)
        except Exception as exc:  # noqa: BLE001 - answered with its status
            return openai_error(status_of(exc), message_of(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _body(self, request: Request) -> dict:
        if not self.control.enabled:
            raise ModelUnavailableError(CONTROL_REFUSED.format(mode=self.control.mode))
        body = parse_json(await read_body(request, self.body_limit))
        if not isinstance(body, dict):
            raise InvalidInputError("the request body must be a JSON object")
        return body

    def _base(self, body: dict) -> ModelVersion:
        """The model an adapter is loaded for: `base_model`, or the one generation model loaded."""
        base = body.get("base_model")
        if base is not None:
            return serving(self.registry, _text(body, "base_model"), "", GENERATE)
        models = sorted({mv.name for mv in _generation_models(self.registry)})
        if len(models) != 1:
            raise InvalidInputError(f"name the adapter's model in 'base_model' (generation models loaded: "
                                    f"{', '.join(models) or 'none'})")
        return serving(self.registry, models[0], "", GENERATE)


def _text(body: dict, key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidInputError(f"'{key}' must be a non-empty string")
    return value
