"""The manifests and the image agree: the Dockerfile's ENTRYPOINT, ports and user are what the
Kubernetes and KServe manifests assume, every argument they pass is one `ferry serve` accepts, the pod
outlives its drain, and the metric the autoscaler reads is one Ferry exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from deploy import validate
from server.doors.grpc.server import LIVENESS_SERVICE
from tests.conftest import ROOT


def dockerfile() -> dict:
    text = (ROOT / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    return {"entrypoint": entrypoint, "expose": {int(p) for p in re.search(r"^EXPOSE (.*)$", text, re.M).group(1).split()},
            "user": int(re.search(r"^USER (\d+)$", text, re.M).group(1)), "flags": _flags(entrypoint)}


def _flags(args: list[str]) -> dict[str, str]:
    return {a: b for a, b in zip(args, [*args[1:], ""]) if a.startswith("--")}


def objects(folder: str, kind: str) -> list[dict]:
    return [doc for _, doc in validate.build(ROOT / "deploy" / folder) if doc["kind"] == kind]


def pod_spec() -> dict:
    (deployment,) = objects("kubernetes", "Deployment")
    return deployment["spec"]["template"]["spec"]


def runtime_container() -> dict:
    (runtime,) = objects("kserve", "ClusterServingRuntime")
    (container,) = runtime["spec"]["containers"]
    return container


def test_containers_keep_the_entrypoint_and_use_its_ports():
    image = dockerfile()
    assert image["entrypoint"][:2] == ["ferry", "serve"] and image["flags"]["--host"] == "0.0.0.0"
    grpc_port, metrics_port = int(image["flags"]["--grpc-port"]), int(image["flags"]["--metrics-port"])
    http_port = int(image["flags"]["--http-port"])
    assert image["expose"] == {http_port, grpc_port, metrics_port}

    (container,) = pod_spec()["containers"]
    assert "command" not in container  # the ENTRYPOINT runs; manifests add arguments only
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": http_port, "grpc": grpc_port, "metrics": metrics_port}
    assert container["readinessProbe"]["grpc"] == {"port": grpc_port}  # service "": ready to serve
    assert container["livenessProbe"]["grpc"] == {"port": grpc_port, "service": LIVENESS_SERVICE}
    for service in objects("kubernetes", "Service"):
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"]

    kserve = runtime_container()
    assert "command" not in kserve
    assert [(p["name"], p["containerPort"]) for p in kserve["ports"]] == [("h2c", grpc_port)]
    (runtime,) = objects("kserve", "ClusterServingRuntime")
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(metrics_port)


def test_pods_run_as_the_image_user_with_a_read_only_root():
    spec = pod_spec()
    (container,) = spec["containers"]
    assert spec["securityContext"]["runAsUser"] == dockerfile()["user"] and spec["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert runtime_container()["securityContext"]["runAsUser"] == dockerfile()["user"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) <= set(container["resources"]["limits"])


def test_the_model_repository_is_the_mounted_volume():
    (container,) = pod_spec()["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    assert _flags(container["args"])["--model-repository"] == mounts["models"]["mountPath"]
    assert mounts["models"]["readOnly"] and volumes["models"]["persistentVolumeClaim"]["claimName"] == "ferry-models"
    assert _flags(runtime_container()["args"])["--model-repository"] == "/mnt/models"  # where KServe puts storageUri


def test_pods_outlive_their_drain():
    spec = pod_spec()
    (container,) = spec["containers"]
    drain = float(_flags(container["args"])["--drain-grace-seconds"])
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
    (isvc,) = objects("kserve", "InferenceService")
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] > float(
        _flags(runtime_container()["args"])["--drain-grace-seconds"])


@pytest.mark.parametrize("source", ["kubernetes", "kserve"])
def test_every_argument_is_one_ferry_serve_accepts(source):
    args = pod_spec()["containers"][0]["args"] if source == "kubernetes" else runtime_container()["args"]
    usage = subprocess.run([sys.executable, "-m", "server", "serve", "--help"], cwd=ROOT, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    accepted = set(re.findall(r"(--[a-z][a-z0-9-]*)", usage))
    assert {a for a in [*args, *dockerfile()["entrypoint"]] if a.startswith("--")} <= accepted


def test_the_autoscaler_reads_a_queue_metric_ferry_exports():
    (hpa,) = objects("kubernetes", "HorizontalPodAutoscaler")
    (rules,) = objects("kubernetes", "ConfigMap")
    (rule,) = yaml.safe_load(rules["data"]["config.yaml"])["rules"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = re.match(r"\^(\w+)\$", rule["name"]["matches"]).group(1)
    assert series in rule["seriesQuery"]
    assert f'"{series}"' in (ROOT / "server" / "observability" / "metrics.py").read_text()  # exported per model (a gauge)
