"""Run by test_http_kserve.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): Triton's `simple_http_*` flows with tritonclient.http, unchanged. Prints JSON."""

import json
import sys

import numpy as np
import tritonclient.http as th
from tritonclient.utils import InferenceServerException


def error(fn):
    try:
        fn()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def simple_inputs(a, b, binary=True):
    inputs = [th.InferInput("INPUT0", list(a.shape), "FP32"), th.InferInput("INPUT1", list(b.shape), "FP32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary)
    inputs[1].set_data_from_numpy(b, binary_data=binary)
    return inputs


def infer_flows(client, out) -> None:
    a = np.arange(32, dtype=np.float32).reshape(2, 16)
    b = np.full((2, 16), 2, np.float32)
    result = client.infer("simple", simple_inputs(a, b), request_id="h-1")  # binary in, binary out (the default)
    out["binary_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT0"), a + b) and np.array_equal(result.as_numpy("OUTPUT1"), a - b))
    out["id"] = result.get_response()["id"]
    json_outputs = [th.InferRequestedOutput("OUTPUT0", binary_data=False), th.InferRequestedOutput("OUTPUT1", binary_data=False)]
    result = client.infer("simple", simple_inputs(a, b, binary=False), outputs=json_outputs)  # JSON both ways
    out["json_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT0"), a + b) and np.array_equal(result.as_numpy("OUTPUT1"), a - b))
    out["json_output_params"] = [o.get("parameters") for o in result.get_response()["outputs"]]
    subset = client.infer("simple", simple_inputs(a, b), outputs=[th.InferRequestedOutput("OUTPUT1", binary_data=True)])
    out["subset_outputs"] = [o["name"] for o in subset.get_response()["outputs"]]
    for algorithm in ("gzip", "deflate"):
        result = client.infer("simple", simple_inputs(a, b), request_compression_algorithm=algorithm)
        out[f"{algorithm}_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT0"), a + b))
    texts = np.array([[b"hello", "w\u00f6rld".encode()], [b"", b"\x00\x01"]], dtype=object)
    text_in = th.InferInput("TEXT", [2, 2], "BYTES")
    text_in.set_data_from_numpy(texts)
    out["bytes_ok"] = client.infer("echo", [text_in]).as_numpy("TEXT_OUT").tolist() == texts.tolist()
    words = np.array([["ferry", "b\u00e5t"]], dtype=object)
    json_text = th.InferInput("TEXT", [1, 2], "BYTES")
    json_text.set_data_from_numpy(words, binary_data=False)
    echoed = client.infer("echo", [json_text], outputs=[th.InferRequestedOutput("TEXT_OUT", binary_data=False)])
    out["bytes_json"] = [v.decode() if isinstance(v, bytes) else v for v in echoed.as_numpy("TEXT_OUT").reshape(-1)]
    out["unknown_model"] = error(lambda: client.infer("nope", simple_inputs(a, b)))
    wrong = th.InferInput("INPUT0", [2, 16], "FP64")
    wrong.set_data_from_numpy(a.astype(np.float64))
    out["wrong_dtype"] = error(lambda: client.infer("simple", [wrong, simple_inputs(a, b)[1]]))
    out["generation_model"] = error(lambda: client.infer("tiny_llama", simple_inputs(a, b)))


def main(url: str) -> None:
    client = th.InferenceServerClient(url)
    out = {"live": client.is_server_live(), "ready": client.is_server_ready(), "model_ready": client.is_model_ready("simple"),
           "broken_ready": client.is_model_ready("broken"), "extensions": client.get_server_metadata()["extensions"],
           "model_metadata": client.get_model_metadata("simple"), "config": client.get_model_config("simple")}
    infer_flows(client, out)
    out["index"] = client.get_model_repository_index()
    out["stats"] = client.get_inference_statistics("simple")["model_stats"][0]
    client.unload_model("simple")
    out["ready_after_unload"] = client.is_model_ready("simple")
    out["infer_after_unload"] = error(lambda: client.infer("simple", simple_inputs(np.ones((1, 16), np.float32), np.ones((1, 16), np.float32))))
    client.load_model("simple")
    out["ready_after_load"] = client.is_model_ready("simple")
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
