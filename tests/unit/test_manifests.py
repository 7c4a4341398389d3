"""deploy/ checked offline, as CI does: every manifest against Kubernetes' or KServe's schemas, and a
broken copy of each kind of manifest is refused with its file named (so the check is known to bite)."""

from __future__ import annotations

import shutil

import pytest

from deploy import validate
from tests.conftest import ROOT

FOLDERS = ["deploy/kubernetes", "deploy/kubernetes/gpu", "deploy/kserve"]


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_manifest_is_valid(folder):
    objects = validate.check_folder(ROOT / folder)
    assert objects and all(doc.get("kind") for _, doc in objects)


def test_the_folders_hold_what_a_cluster_needs():
    kinds = {doc["kind"] for _, doc in validate.build(ROOT / "deploy/kubernetes")}
    assert kinds == {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ServiceMonitor",
                     "ConfigMap", "PersistentVolumeClaim", "NetworkPolicy"}
    kserve = {doc["kind"] for _, doc in validate.build(ROOT / "deploy/kserve")}
    assert kserve == {"ClusterServingRuntime", "InferenceService", "NetworkPolicy"}
    gpu = next(d for _, d in validate.build(ROOT / "deploy/kubernetes/gpu") if d["kind"] == "Deployment")
    assert gpu["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


BREAKAGES = [  # (file, text in it, replacement, what the error names)
    ("kubernetes/deployment.yaml", "terminationGracePeriodSeconds: 45", "terminationGracePeriodSecond: 45",
     "terminationGracePeriodSecond"),
    ("kubernetes/deployment.yaml", "containerPort: 8001", "containerPort: grpc", "containerPort"),
    ("kubernetes/hpa.yaml", "minReplicas: 2", "minReplicas: two", "minReplicas"),
    ("kubernetes/pdb.yaml", "apiVersion: policy/v1", "apiVersion: policy/v0", "PodDisruptionBudget"),
    ("kubernetes/servicemonitor.yaml", "interval: 15s", "intervall: 15s", "intervall"),
    ("kserve/clusterservingruntime.yaml", "    - v2\n    - grpc-v2", "    grpc-v2", "protocolVersions"),
    ("kserve/clusterservingruntime.yaml", "priority: 1", "priority: 0", "priority"),
    ("kserve/inferenceservice.yaml", "      runtime: ferry", "      runtimeName: ferry", "runtimeName"),
]


@pytest.mark.parametrize("file,old,new,named", BREAKAGES, ids=[f"{b[0]}:{b[3]}" for b in BREAKAGES])
def test_a_broken_copy_is_refused(tmp_path, file, old, new, named):
    copy = tmp_path / "deploy"
    if file.startswith("kserve/") or "servicemonitor" in file:
        if not validate.schemas_present():
            pytest.skip(reason=f"custom-resource schemas are not on this machine ({validate.SCHEMAS}); they live "
                               "beside the checkout in ../shared/data/k8s-schemas, not in the project")
    shutil.copytree(ROOT / "deploy", copy)
    target = copy / file
    text = target.read_text()
    assert old in text, f"{file} no longer contains {old!r}: update this breakage"
    target.write_text(text.replace(old, new))
    with pytest.raises(validate.ManifestError) as caught:
        validate.check_folder(target.parent)
    assert target.name in str(caught.value) and named in str(caught.value), caught.value


def test_a_manifest_left_out_of_the_kustomization_is_refused(tmp_path):
    copy = tmp_path / "kubernetes"
    shutil.copytree(ROOT / "deploy/kubernetes", copy)
    (copy / "extra.yaml").write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    with pytest.raises(validate.ManifestError, match="extra.yaml"):
        validate.build(copy)
