"""The one way a front-door call finds a runner that can serve it, or learns why none can."""

from __future__ import annotations

from server.errors import InvalidInputError, UnsupportedError
from server.repository.registry import ModelVersion, Registry
from server.runners.base import DECOUPLED, GENERATE, INFER


def serving(registry: Registry, name: str, version: str, serves: str) -> ModelVersion:
    """The ready version of `name` whose runner serves `serves` (INFER or GENERATE); raises otherwise."""
    mv = registry.get(name, version)
    if mv.runner.serves == serves:
        return mv
    if serves == INFER and mv.runner.serves == DECOUPLED:
        raise UnsupportedError(f"ModelInfer does not serve model '{mv.name}': its transaction policy is decoupled "
                               "(0..N responses per request); send its requests on ModelStreamInfer")
    if serves == INFER:
        raise UnsupportedError(f"ModelInfer does not serve generation model '{mv.name}' (decoupled); stream from it "
                               "with ModelStreamInfer or ferry.generate.v1.Generation/Generate")
    if serves == GENERATE:
        raise InvalidInputError(f"model '{mv.name}' is not a generation model (its backend is {mv.config.backend!r})")
    raise UnsupportedError(f"model '{mv.name}' cannot serve {serves!r} calls")
