"""The access table (server/doors/access.py): every RPC of the KServe service is classified on purpose, the
control calls are exactly the ones that change what is served or how the server behaves, and Triton's
restricted-API flag syntax is parsed with errors that say what is wrong."""

from __future__ import annotations

import pytest

from protos import grpc_service_pb2 as pb
from server.doors.access import (CATEGORIES, GRPC_OPERATIONS, AccessPolicy, Operation, grpc_operation, http_operation,
                           parse_restriction, restriction_table)
from server.doors.tokens import Tokens

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
CONTROL_RPCS = {"RepositoryModelLoad", "RepositoryModelUnload", "LogSettings", "TraceSetting"}


def test_every_kserve_rpc_is_classified_and_only_the_control_ones_need_the_admin():
    methods = {f"/inference.GRPCInferenceService/{m.name}" for m in SERVICE.methods}
    assert methods <= set(GRPC_OPERATIONS), sorted(methods - set(GRPC_OPERATIONS))
    assert {m.rsplit("/", 1)[1] for m in methods if grpc_operation(m).control} == CONTROL_RPCS
    assert all(op.category in CATEGORIES for op in GRPC_OPERATIONS.values())


@pytest.mark.parametrize("path, category, control", [
    ("/v2/health/ready", "health", False), ("/v2/models/m/versions/1/ready", "health", False),
    ("/v2", "metadata", False), ("/v2/models/m", "metadata", False), ("/v2/models/m/config", "model-config", False),
    ("/v2/models/m/stats", "statistics", False), ("/v2/models/stats", "statistics", False),
    ("/v2/models/m/infer", "inference", False), ("/v2/models/m/generate_stream", "inference", False),
    ("/v1/chat/completions", "inference", False), ("/v2/repository/index", "model-repository", False),
    ("/v2/repository/models/m/load", "model-repository", True), ("/v2/repository/models/m/unload", "model-repository", True),
    ("/v2/logging", "logging", True), ("/v2/trace/setting", "trace", True), ("/v2/models/m/trace/setting", "trace", True),
    ("/v2/systemsharedmemory/region/r/register", "shared-memory", False),
])
def test_http_routes_fall_in_the_category_their_grpc_twins_are_in(path, category, control):
    assert http_operation(path) == Operation(category, control=control, probe=path == "/v2/health/ready")


def test_restriction_syntax_is_tritons_and_errors_say_what_is_wrong():
    group = parse_restriction("model-repository, logging:Admin-Key=s3cret=x")
    assert group.categories == {"model-repository", "logging"}
    assert (group.header, group.value) == ("admin-key", "s3cret=x")  # header names are case-insensitive
    with pytest.raises(ValueError, match=r"unknown category \['models'\]"):
        parse_restriction("models:k=v")
    with pytest.raises(ValueError, match="<categories>:<key>=<value>"):
        parse_restriction("inference:k")
    with pytest.raises(ValueError, match="restricted twice"):
        restriction_table([parse_restriction("inference:a=1"), parse_restriction("inference,health:b=2")])


def test_both_locks_apply_and_a_restricted_probe_needs_its_header():
    policy = AccessPolicy(Tokens(inference=(b"t",)), restriction_table([parse_restriction("health:k=v")], "p-"))
    probe = grpc_operation("/inference.GRPCInferenceService/ServerLive")
    assert policy.check(probe, {}.get).kind == "restricted"
    assert policy.check(probe, {"p-k": "v"}.get) is None  # a probe needs no token
    infer = grpc_operation("/inference.GRPCInferenceService/ModelInfer")
    assert policy.check(infer, {}.get).kind == "unauthenticated"
    assert policy.check(infer, {"authorization": "Bearer t"}.get) is None
    load = grpc_operation("/inference.GRPCInferenceService/RepositoryModelLoad")
    assert policy.check(load, {"authorization": "Bearer t"}.get).kind == "forbidden"
