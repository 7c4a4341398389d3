"""Run by test_triton_parity.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): the flows of Triton's example clients, printed as JSON. argv: url, scenario."""

import json
import os
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


def classification(client) -> dict:
    """image_client.py -c 3 against densenet_onnx: top-3 "score:index:label" strings."""
    image = np.random.default_rng(0).random((3, 4, 4), dtype=np.float32)
    data = tc.InferInput("data_0", [3, 4, 4], "FP32")
    data.set_data_from_numpy(image)
    top3 = client.infer("densenet_onnx", [data], outputs=[tc.InferRequestedOutput("fc6_1", class_count=3)])
    raw = client.infer("densenet_onnx", [data]).as_numpy("fc6_1")
    batch = np.stack([image, image[::-1]])
    rows = tc.InferInput("data_0", [2, 3, 4, 4], "FP32")
    rows.set_data_from_numpy(batch)
    batched = client.infer("densenet_batched", [rows], outputs=[tc.InferRequestedOutput("fc6_1", class_count=2)])
    bad_k = tc.InferRequestedOutput("fc6_1")
    bad_k._output.parameters["classification"].int64_param = 0
    return {
        "server_name": client.get_server_metadata().name,
        "image": image.tolist(), "batch": batch.tolist(),
        "top3": [v.decode() for v in top3.as_numpy("fc6_1").tolist()], "top3_shape": list(top3.as_numpy("fc6_1").shape),
        "raw_shape": list(raw.shape), "raw": raw.tolist(),
        "batched": [[v.decode() for v in row] for row in batched.as_numpy("fc6_1").tolist()],
        "bad_k": error(lambda: client.infer("densenet_onnx", [data], outputs=[bad_k])),
        "metadata_shape": client.get_model_metadata("densenet_onnx", as_json=True)["inputs"][0]["shape"],
    }


def model_control(client) -> dict:
    """simple_grpc_model_control.py's flow, in explicit mode, plus a model sent inline."""
    out = {"ready_at_start": {m: client.is_model_ready(m) for m in ("simple", "later")}}
    out["bad_config"] = error(lambda: client.load_model("simple", config='"parameters": {"config": {{"max_batch_size": "16"}}}'))
    client.load_model("simple", config='{"max_batch_size":"16"}')
    out["overridden_max_batch_size"] = client.get_model_config("simple").config.max_batch_size
    client.unload_model("simple")
    out["ready_after_unload"] = client.is_model_ready("simple")
    client.load_model("later")
    out["later_ready"] = client.is_model_ready("later")
    with open(os.environ["INLINE_MODEL"], "rb") as f:
        model = f.read()
    config = json.dumps({"backend": "onnxruntime", "max_batch_size": 4})
    client.load_model("inline", config=config, files={"file:1/model.onnx": model})
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    inputs = [tc.InferInput("INPUT0", [2, 4], "FP32"), tc.InferInput("INPUT1", [2, 4], "FP32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    out["inline_sum_ok"] = bool(np.array_equal(client.infer("inline", inputs).as_numpy("OUTPUT0"), a + a))
    client.unload_model("inline")
    out["inline_ready_after_unload"] = client.is_model_ready("inline")
    out["unknown"] = error(lambda: client.load_model("wrong_model_name"))
    out["long_path"] = error(lambda: client.load_model("simple", config="{}", files={"file:" + "A" * 256: b"a"}))
    out["escaping_path"] = error(lambda: client.load_model("x", config="{}", files={"file:../x/1/model.onnx": b"a"}))
    out["live"] = client.is_server_live()
    return out


def control_refused(client) -> dict:
    return {"load": error(lambda: client.load_model("simple")), "unload": error(lambda: client.unload_model("simple"))}


def shared_memory_refused(client) -> dict:
    """Not implemented yet: every shared memory call says so, never grpc's placeholder text."""
    data = tc.InferInput("INPUT0", [1, 4], "FP32")
    data.set_shared_memory("input_data", 16)
    other = tc.InferInput("INPUT1", [1, 4], "FP32")
    other.set_data_from_numpy(np.ones((1, 4), np.float32))
    return {
        "register": error(lambda: client.register_system_shared_memory("input_data", "/ferry_test", 16)),
        "status": error(lambda: client.get_system_shared_memory_status()),
        "cuda": error(lambda: client.get_cuda_shared_memory_status()),
        "infer": error(lambda: client.infer("simple", [data, other])),
    }


SCENARIOS = {"shared_memory_refused": shared_memory_refused, "classification": classification, "model_control": model_control, "control_refused": control_refused}

if __name__ == "__main__":
    url, names = sys.argv[1], sys.argv[2:]
    with tc.InferenceServerClient(url) as client:
        print(json.dumps({name: SCENARIOS[name](client) for name in names}))
