"""The shipped manifests stay locked down (docs/security.md), so a later edit cannot quietly open them:
model control off and no --allow-* flag, tokens from a Secret, and a NetworkPolicy that admits the
serving ports from labelled clients only and the metrics port from the monitoring namespace only."""

from __future__ import annotations

import pytest

from tests.unit.test_deploy_consistency import objects, pod_spec, runtime_container

OPENING_FLAGS = ("--allow-model-upload", "--allow-shared-memory", "--allow-log-settings", "--allow-trace-settings",
                 "--load-model",
                 "--poll-repository-seconds")
CLIENT_LABEL = {"ferry.dev/client": "true"}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}


def containers():
    (container,) = pod_spec()["containers"]
    return {"kubernetes": container, "kserve": runtime_container()}


@pytest.mark.parametrize("where", ["kubernetes", "kserve"])
def test_model_control_and_every_opening_flag_stay_off(where):
    args = containers()[where]["args"]
    assert args[args.index("--model-control-mode") + 1] == "none"
    assert not [a for a in args if a.split("=")[0] in OPENING_FLAGS]


@pytest.mark.parametrize("where", ["kubernetes", "kserve"])
def test_tokens_come_from_a_secret(where):
    env = {e["name"]: e for e in containers()[where]["env"]}
    for name, key in (("FERRY_AUTH_TOKEN", "inference"), ("FERRY_ADMIN_TOKEN", "admin")):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("ferry-tokens", key)
        assert "value" not in env[name]  # never a token written into the manifest


def _rules_by_port(policy: dict) -> dict:
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "an ingress rule without `from` admits every pod in the cluster"
        for port in rule["ports"]:
            rules.setdefault(port["port"], []).extend(rule["from"])
    return rules


def _admits_only(sources: list[dict], allowed: list[dict]) -> None:
    for source in sources:
        assert source in allowed, f"the NetworkPolicy admits {source}"


def test_kubernetes_network_policy_admits_labelled_clients_and_monitoring_only():
    (policy,) = objects("kubernetes", "NetworkPolicy")
    pod_labels = objects("kubernetes", "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    rules = _rules_by_port(policy)
    clients = {"namespaceSelector": {}, "podSelector": {"matchLabels": CLIENT_LABEL}}
    ports = {p["name"] for p in pod_spec()["containers"][0]["ports"]}
    assert set(rules) == ports  # every port the pod opens is covered, none other
    for name in ("http", "grpc"):
        _admits_only(rules[name], [clients])
    _admits_only(rules["metrics"], [{"namespaceSelector": {"matchLabels": MONITORING}}])


def test_kserve_network_policy_selects_the_inference_service_and_admits_its_data_path_only():
    (policy,) = objects("kserve", "NetworkPolicy")
    (service,) = objects("kserve", "InferenceService")
    assert policy["spec"]["podSelector"]["matchLabels"] == {
        "serving.kserve.io/inferenceservice": service["metadata"]["name"]}
    rules = _rules_by_port(policy)
    knative = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "knative-serving"}}}
    clients = {"namespaceSelector": {}, "podSelector": {"matchLabels": CLIENT_LABEL}}
    grpc_port = runtime_container()["ports"][0]["containerPort"]
    _admits_only(rules[grpc_port], [knative, clients])
    _admits_only(rules[8002], [{"namespaceSelector": {"matchLabels": MONITORING}}])
