"""Who may call what: one table of operations that both doors consult, so they cannot disagree.

Every gRPC method and HTTP route is one `Operation`: Triton's restricted-API category (health,
metadata, inference, shared-memory, model-config, model-repository, statistics, trace, logging) and
whether it changes what the server serves or how it behaves (`control`: needs the admin token).
Two independent locks apply, as an operator may use either or both:

- Bearer tokens (server/doors/tokens.py): an inference token may call everything that is not `control`;
  the admin token may call everything. Probes (liveness, readiness, gRPC health) stay open, so
  orchestrators need no secret.
- Triton's restricted categories (`--grpc-restricted-protocol` / `--http-restricted-api`,
  `<categories>:<key>=<value>`): a call in a restricted category must carry the header `<key>` with
  `<value>` (over gRPC the header is `triton-grpc-protocol-<key>`, as Triton names it), probes
  included, so a Triton user's hardening carries over unchanged.

What the server lets anyone do at all (model load/unload, uploads, shared memory, log changes) is
decided by its flags, before either lock: see docs/security.md.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Callable

from server.doors.tokens import FORBIDDEN, Denial, Tokens, authorize

HEALTH, METADATA, INFERENCE, SHARED_MEMORY = "health", "metadata", "inference", "shared-memory"
MODEL_CONFIG, MODEL_REPOSITORY, STATISTICS, TRACE, LOGGING = (
    "model-config", "model-repository", "statistics", "trace", "logging")
CATEGORIES = (HEALTH, METADATA, INFERENCE, SHARED_MEMORY, MODEL_CONFIG, MODEL_REPOSITORY, STATISTICS, TRACE, LOGGING)
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # Triton's: gRPC metadata keys are lower case
RESTRICTED = "restricted"  # a Denial's kind: a restricted category's header is missing or wrong


@dataclass(frozen=True, slots=True)
class Operation:
    category: str
    control: bool = False  # changes what is served or how the server behaves: the admin token's right
    probe: bool = False  # liveness / readiness: open without a token


_KSERVE = "/inference.GRPCInferenceService/"
GRPC_OPERATIONS: dict[str, Operation] = {
    **{_KSERVE + m: Operation(HEALTH, probe=True) for m in ("ServerLive", "ServerReady")},
    "/grpc.health.v1.Health/Check": Operation(HEALTH, probe=True),
    "/grpc.health.v1.Health/Watch": Operation(HEALTH, probe=True),
    _KSERVE + "ModelReady": Operation(HEALTH),
    _KSERVE + "ServerMetadata": Operation(METADATA),
    _KSERVE + "ModelMetadata": Operation(METADATA),
    _KSERVE + "ModelInfer": Operation(INFERENCE),
    _KSERVE + "ModelStreamInfer": Operation(INFERENCE),
    _KSERVE + "ModelConfig": Operation(MODEL_CONFIG),
    _KSERVE + "ModelStatistics": Operation(STATISTICS),
    _KSERVE + "RepositoryIndex": Operation(MODEL_REPOSITORY),
    _KSERVE + "RepositoryModelLoad": Operation(MODEL_REPOSITORY, control=True),
    _KSERVE + "RepositoryModelUnload": Operation(MODEL_REPOSITORY, control=True),
    # One RPC both reads and changes these settings, so the whole RPC is the admin's.
    _KSERVE + "LogSettings": Operation(LOGGING, control=True),
    _KSERVE + "TraceSetting": Operation(TRACE, control=True),
    **{_KSERVE + f"{kind}SharedMemory{verb}": Operation(SHARED_MEMORY)
       for kind in ("System", "Cuda") for verb in ("Register", "Status", "Unregister")},
}
_GRPC_BY_SERVICE = {  # methods not listed above, by service
    "/ferry.generate.v1.Generation/": Operation(INFERENCE),
    "/grpc.reflection.": Operation(METADATA),
}
_GRPC_DEFAULT = Operation(INFERENCE)

# HTTP routes by the first segments of their path; model routes by their last segment.
HTTP_PROBES = frozenset({"/v2/health/live", "/v2/health/ready", "/health", "/ping"})  # vLLM's too (http/probes.py)
_HTTP_MODEL_SUFFIX = {"ready": Operation(HEALTH), "config": Operation(MODEL_CONFIG), "stats": Operation(STATISTICS),
                      "infer": Operation(INFERENCE), "generate": Operation(INFERENCE),
                      "generate_stream": Operation(INFERENCE)}


def grpc_operation(method: str) -> Operation:
    found = GRPC_OPERATIONS.get(method)
    if found is not None:
        return found
    return next((op for prefix, op in _GRPC_BY_SERVICE.items() if method.startswith(prefix)), _GRPC_DEFAULT)


def http_operation(path: str) -> Operation:
    if path in HTTP_PROBES:
        return Operation(HEALTH, probe=True)
    if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        return Operation(MODEL_REPOSITORY, control=True)  # vLLM's: they change what is served
    if path.startswith("/v1/"):
        return Operation(INFERENCE)  # the OpenAI API
    if path.startswith(("/v2/systemsharedmemory", "/v2/cudasharedmemory")):
        return Operation(SHARED_MEMORY)
    if path.startswith("/v2/repository/"):
        return Operation(MODEL_REPOSITORY, control=path.endswith(("/load", "/unload")))
    if path.startswith("/v2/logging"):
        return Operation(LOGGING, control=True)  # as its gRPC twin, reading included
    if path.startswith("/v2/trace") or path.endswith("/trace/setting"):
        return Operation(TRACE, control=True)
    if path == "/v2/models/stats":
        return Operation(STATISTICS)
    if path.startswith("/v2/models/"):
        last = path.rstrip("/").rsplit("/", 1)[-1]
        return _HTTP_MODEL_SUFFIX.get(last, Operation(METADATA))
    return Operation(METADATA)  # /v2 and anything unknown (which then answers 404)


@dataclass(frozen=True, slots=True)
class Restriction:
    """One `<categories>:<key>=<value>` group of a restricted-API flag."""

    categories: frozenset[str]
    header: str
    value: str


def parse_restriction(text: str) -> Restriction:
    """Triton's flag value, checked: known categories, a key and a value. Raises ValueError saying what is wrong."""
    names, sep, pair = text.partition(":")
    header, eq, value = pair.partition("=")
    if not sep or not eq or not names.strip() or not header.strip():
        raise ValueError(f"'{text}' is not <categories>:<key>=<value>, e.g. model-repository,logging:admin-key=SECRET")
    categories = frozenset(n.strip() for n in names.split(","))
    unknown = sorted(categories - set(CATEGORIES))
    if unknown:
        raise ValueError(f"'{text}': unknown categor{'y' if len(unknown) == 1 else 'ies'} {unknown}; "
                         f"known: {', '.join(CATEGORIES)}")
    return Restriction(categories, header.strip().lower(), value)


def restriction_table(groups: list[Restriction], header_prefix: str = "") -> dict[str, tuple[str, bytes]]:
    """category -> (header, value) for one door; a category may be in one group only, as in Triton."""
    table: dict[str, tuple[str, bytes]] = {}
    for group in groups:
        for category in sorted(group.categories):
            if category in table:
                raise ValueError(f"category '{category}' is restricted twice; each category belongs to one group")
            table[category] = (header_prefix + group.header, group.value.encode())
    return table


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """The two locks for one door. `header(name)` gives a request header's value (str, bytes or None)."""

    tokens: Tokens = field(default_factory=Tokens)
    restricted: dict[str, tuple[str, bytes]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.tokens.enabled or bool(self.restricted)

    def check(self, operation: Operation, header: Callable[[str], str | bytes | None]) -> Denial | None:
        rule = self.restricted.get(operation.category)
        if rule is not None and not _equal(header(rule[0]), rule[1]):
            return Denial(RESTRICTED, f"This protocol is restricted, expecting header '{rule[0]}' "
                                      f"(the '{operation.category}' category needs it on this server)")
        if operation.probe or not self.tokens.enabled:
            return None
        return authorize(self.tokens, header("authorization"), operation.control)


def _equal(given: str | bytes | None, expected: bytes) -> bool:
    if given is None:
        return False
    return hmac.compare_digest(given.encode() if isinstance(given, str) else given, expected)


__all__ = ["AccessPolicy", "CATEGORIES", "Denial", "FORBIDDEN", "GRPC_HEADER_PREFIX", "Operation", "RESTRICTED",
           "Restriction", "grpc_operation", "http_operation", "parse_restriction", "restriction_table"]
