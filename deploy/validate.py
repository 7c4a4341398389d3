"""Check Ferry's manifests offline, the way CI does: `python deploy/validate.py [FOLDER ...]`.

No cluster is needed. Built-in kinds are checked by the `kubernetes-validate` package against
Kubernetes' own OpenAPI schemas (strict: an unknown or misspelt field is an error, where `kubectl
apply` would drop it silently). Custom resources (KServe, the Prometheus Operator) are checked against
their CRDs' schemas, made strict the same way. Those schemas are other projects' data, so the project
does not carry them: they are read from `../shared/data/k8s-schemas` beside the checkout (its README
names their sources), or from the folder in `FERRY_K8S_SCHEMAS`; where neither exists, only the
custom resources go unchecked, and the output says so. A folder is read through its
kustomization.yaml, so an overlay is checked as it would be applied (its JSON patches included), and a
manifest left out of the kustomization is an error too.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
SCHEMAS = Path(os.environ.get("FERRY_K8S_SCHEMAS", HERE.parent.parent / "shared" / "data" / "k8s-schemas"))
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # the oldest with preStop sleep on by default, and the newest
CUSTOM = {  # (apiVersion, kind) -> the schema file made from its CRD (deploy/extract_crd_schema.py)
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "clusterservingruntime-v1alpha1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "inferenceservice-v1beta1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json",
}


class ManifestError(Exception):
    """A manifest that would not apply as written; the message names the file and the field."""


def schemas_present() -> bool:
    return all((SCHEMAS / name).is_file() for name in CUSTOM.values())


def build(folder: Path) -> list[tuple[Path, dict]]:
    """Every object a kustomization produces, with the file it came from."""
    folder = Path(folder)
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    listed = kustomization.get("resources", [])
    unlisted = {p.name for p in folder.glob("*.yaml")} - set(listed) - {"kustomization.yaml"}
    if unlisted:
        raise ManifestError(f"{folder}: {sorted(unlisted)} not in kustomization.yaml's resources")
    objects = []
    for entry in listed:
        path = (folder / entry).resolve()
        if path.is_dir():
            objects += build(path)
        elif not path.exists():
            raise ManifestError(f"{folder / 'kustomization.yaml'}: resource {entry} does not exist")
        else:
            objects += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        objects = [(path, _patched(doc, patch, path)) for path, doc in objects]
    return objects


def check(path: Path, doc: dict) -> bool:
    """True when checked; False for a custom resource whose schema is not on this machine."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CUSTOM:
        if not schemas_present():
            return False
        _check_custom(path, doc, CUSTOM[key])
        return True
    import kubernetes_validate

    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except (kubernetes_validate.ValidationError, kubernetes_validate.SchemaNotFoundError) as exc:
            where = "/".join(str(p) for p in getattr(exc, "path", ()))
            raise ManifestError(f"{path}: {key[1]} {_name(doc)} (Kubernetes {version}) at {where or '/'}: "
                                f"{getattr(exc, 'message', exc)}") from None
    return True


def check_folder(folder: Path) -> list[tuple[Path, dict]]:
    objects = build(folder)
    for path, doc in objects:
        check(path, doc)
    return objects


def strict(schema):
    """An object schema that lists its properties rejects any other, unless it says it keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _check_custom(path: Path, doc: dict, schema_file: str) -> None:
    import jsonschema

    schema = strict(json.loads((SCHEMAS / schema_file).read_text()))
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        where = "/".join(str(p) for p in first.absolute_path)
        raise ManifestError(f"{path}: {doc['kind']} {_name(doc)} ({schema_file}) at {where or '/'}: {first.message}")


def _patched(doc: dict, patch: dict, path: Path) -> dict:
    target = patch.get("target", {})
    if any(_field(doc, k) != v for k, v in target.items()):
        return doc
    out = copy.deepcopy(doc)
    for op in yaml.safe_load(patch["patch"]):
        if op["op"] not in ("add", "replace"):
            raise ManifestError(f"{path}: patch op {op['op']!r} is not supported by this checker")
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        node = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = op["value"]
    return out


def _field(doc: dict, key: str):
    """What a kustomize patch target's key selects on: `name` is the object's name, the rest top-level."""
    return _name(doc) if key == "name" else doc.get(key)


def _name(doc: dict) -> str:
    return doc.get("metadata", {}).get("name", "?")


if __name__ == "__main__":
    folders = [Path(a) for a in sys.argv[1:]] or [HERE / "kubernetes", HERE / "kubernetes" / "gpu", HERE / "kserve"]
    try:
        for folder in folders:
            for path, doc in build(folder):
                verdict = "ok  " if check(path, doc) else "skip"
                print(f"{verdict} {path.relative_to(HERE.parent) if path.is_relative_to(HERE.parent) else path}: "
                      f"{doc['kind']} {_name(doc)}")
        if not schemas_present():
            print(f"custom resources not checked: their schemas are not at {SCHEMAS} (set FERRY_K8S_SCHEMAS)")
    except ManifestError as exc:
        sys.exit(f"invalid: {exc}")
