"""The probes vLLM, SGLang and TGI serve beside their OpenAI API, which LLM benchmark tools (GuideLLM)
and load balancers call before anything else: `GET /health` (200 ready, 503 not ready or draining, no
body), vLLM's `/ping` (the same answer, GET or POST, as SageMaker calls it) and `GET /version`.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server import __version__


class ProbeRoutes:
    def __init__(self, health):
        self.health = health

    def routes(self) -> list[Route]:
        return [Route("/health", self.health_check, methods=["GET"]), Route("/ping", self.health_check, methods=["GET", "POST"]),
                Route("/version", self.version, methods=["GET"])]

    async def health_check(self, request: Request) -> Response:
        return Response(status_code=200 if self.health.ready else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})
