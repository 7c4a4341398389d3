"""Run by test_tritonclient.py in its own process: tritonclient's `inference.*` protobuf messages
cannot share a process with Ferry's. Calls the server the way Triton users do and prints JSON."""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException


def error(fn):
    try:
        fn()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def main(url: str) -> None:
    client = tc.InferenceServerClient(url)
    out = {"live": client.is_server_live(), "ready": client.is_server_ready(),
           "model_ready": client.is_model_ready("simple")}
    meta = client.get_server_metadata(as_json=True)
    out["extensions"] = meta["extensions"]
    out["model_metadata"] = client.get_model_metadata("simple", as_json=True)
    out["config"] = client.get_model_config("simple", as_json=True)["config"]
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 2, np.float32)
    inputs = [tc.InferInput("INPUT0", [2, 4], "FP32"), tc.InferInput("INPUT1", [2, 4], "FP32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("simple", inputs, request_id="t-1")
    out["sum_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT0"), a + b))
    out["diff_ok"] = bool(np.array_equal(result.as_numpy("OUTPUT1"), a - b))
    out["id"] = result.get_response().id
    subset = client.infer("simple", inputs, outputs=[tc.InferRequestedOutput("OUTPUT1")])
    out["subset_outputs"] = [o.name for o in subset.get_response().outputs]
    texts = np.array([[b"hello", "w\u00f6rld".encode()], [b"", b"\x00\x01"]], dtype=object)
    text_in = tc.InferInput("TEXT", [2, 2], "BYTES")
    text_in.set_data_from_numpy(texts)
    echoed = client.infer("echo", [text_in]).as_numpy("TEXT_OUT")
    out["bytes_ok"] = echoed.tolist() == texts.tolist()
    out["unknown_model"] = error(lambda: client.infer("nope", inputs))
    wrong = tc.InferInput("INPUT0", [2, 4], "FP64")
    wrong.set_data_from_numpy(a.astype(np.float64))
    out["wrong_dtype"] = error(lambda: client.infer("simple", [wrong, inputs[1]]))
    out["index"] = client.get_model_repository_index(as_json=True)["models"]
    out["stats"] = client.get_inference_statistics("simple", as_json=True)["model_stats"][0]
    out["stream"] = stream_calls(client, inputs, a + b)
    out["log_settings"] = client.get_log_settings(as_json=True)["settings"]
    out["log_updated"] = client.update_log_settings({"log_verbose_level": 1, "log_info": True}, as_json=True)["settings"]
    client.update_log_settings({"log_verbose_level": 0})
    print(json.dumps(out))


def stream_calls(client, inputs, expected_sum) -> dict:
    """ModelStreamInfer: three ordinary requests answered in order, one streamed generation."""
    received = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    for i in range(3):
        client.async_stream_infer("simple", inputs, request_id=f"s{i}")
    text = tc.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"A ferry leaves"], dtype=object))
    stream = tc.InferInput("stream", [1], "BOOL")
    stream.set_data_from_numpy(np.array([True]))
    sampling = tc.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps({"max_tokens": 8, "ignore_eos": True}).encode()], dtype=object))
    client.async_stream_infer("tiny_llama", [text, stream, sampling], request_id="g1")
    client.async_stream_infer("nope", inputs, request_id="bad")
    order, sums_ok, deltas, finals, errors = [], True, [], 0, []
    while finals < 1 or len(order) < 3 or not errors:
        result, error = received.get(timeout=60)
        if error is not None:
            errors.append(str(error))
            continue
        response = result.get_response()
        if response.id.startswith("s"):
            order.append(response.id)
            sums_ok &= bool(np.array_equal(result.as_numpy("OUTPUT0"), expected_sum))
        else:
            deltas.append(result.as_numpy("text_output")[0].decode())
            finals += response.parameters["triton_final_response"].bool_param
    client.stop_stream()
    return {"order": order, "sums_ok": sums_ok, "deltas": deltas, "errors": errors}


if __name__ == "__main__":
    main(sys.argv[1])
