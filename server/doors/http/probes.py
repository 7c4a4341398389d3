"""What vLLM, SGLang and TGI serve beside their OpenAI API, which LLM benchmark tools (GuideLLM, AIPerf)
and load balancers call: `GET /health` (200 ready, 503 not ready or draining, no body), vLLM's `/ping`
(the same answer, GET or POST, as SageMaker calls it), `GET /version`, and `GET /metrics`: the page the
metrics port serves, where vLLM serves it (AIPerf scrapes `<url>/metrics` for the server's figures).
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from server import __version__
from server.observability.exposition import CONTENT_TYPE, render


class ProbeRoutes:
    def __init__(self, health, metrics: CollectorRegistry | None = None):
        """`metrics`: the server's registry (None: no /metrics here, as for `ferry batch`'s in-process door)."""
        self.health, self.metrics = health, metrics

    def routes(self) -> list[Route]:
        routes = [Route("/health", self.health_check, methods=["GET"]), Route("/ping", self.health_check, methods=["GET", "POST"]),
                  Route("/version", self.version, methods=["GET"])]
        if self.metrics is not None:
            routes.append(Route("/metrics", self.scrape, methods=["GET"]))
        return routes

    async def health_check(self, request: Request) -> Response:
        return Response(status_code=200 if self.health.ready else 503)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def scrape(self, request: Request) -> Response:
        page = await asyncio.to_thread(render, self.metrics)  # the collectors take the stats' locks: off the loop
        return Response(page, media_type=CONTENT_TYPE)
