"""Turn an upstream CustomResourceDefinition into the JSON Schema deploy/validate.py checks custom resources against.

Kept so the schema files can be refreshed from a newer release and the diff read: descriptions are
dropped (they are most of the bytes and no validation reads them), nothing else is changed.
Usage: python deploy/extract_crd_schema.py CRD.yaml VERSION > ../shared/data/k8s-schemas/<kind>.json
(the schemas are other projects' data: they live beside the checkout, never in it)
"""

from __future__ import annotations

import json
import sys

import yaml


def without_descriptions(node):
    if isinstance(node, dict):
        return {k: without_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def schema(crd: dict, version: str) -> dict:
    for served in crd["spec"]["versions"]:
        if served["name"] == version:
            return without_descriptions(served["schema"]["openAPIV3Schema"])
    raise SystemExit(f"{crd['metadata']['name']} has no version {version}")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        crd = next(doc for doc in yaml.safe_load_all(f) if doc)
    json.dump(schema(crd, sys.argv[2]), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
