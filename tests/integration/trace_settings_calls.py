"""Run by test_tracing.py in its own process (tritonclient's `inference.*` protobuf messages cannot share a
process with Ferry's): read and change trace settings over gRPC the way Triton users do; prints JSON."""

import json
import sys

import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException


def settings(response) -> dict:
    return {key: value["value"] for key, value in response["settings"].items()}


def main(url: str) -> None:
    client = tc.InferenceServerClient(url)
    out = {"global": settings(client.get_trace_settings(as_json=True)),
           "extensions": client.get_server_metadata(as_json=True)["extensions"]}
    out["model_updated"] = settings(client.update_trace_settings(model_name="simple", settings={"trace_rate": "3"},
                                                                 as_json=True))
    out["model"] = settings(client.get_trace_settings(model_name="simple", as_json=True))
    out["global_after"] = settings(client.get_trace_settings(as_json=True))
    try:
        client.update_trace_settings(settings={"trace_rate": "fast"})
        out["bad"] = None
    except InferenceServerException as exc:
        out["bad"] = {"status": exc.status(), "message": exc.message()}
    try:
        client.update_trace_settings(model_name="no_such_model", settings={"trace_rate": "2"})
        out["unknown"] = None
    except InferenceServerException as exc:
        out["unknown"] = {"status": exc.status(), "message": exc.message()}
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
