"""Run by test_triton_parity.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): the flows of Triton's example clients, printed as JSON. argv: url, scenario."""

import json
import os
import sys

import numpy as np
import tritonclient.grpc as tc
from tritonclient_calls import error  # run as a script: its folder is on sys.path


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


def shared_memory(client) -> dict:
    """simple_grpc_shm_client.py's and simple_grpc_shm_string_client.py's flows, then each error they can meet."""
    from tritonclient.utils import serialize_byte_tensor, serialized_byte_size, triton_to_np_dtype
    from tritonclient.utils import shared_memory as shm

    tag = os.environ["SHM_TAG"]
    a, b = np.arange(16, dtype=np.float32).reshape(4, 4), np.full((4, 4), 0.5, np.float32)
    client.unregister_system_shared_memory()  # both examples begin by clearing both kinds of regions
    client.unregister_cuda_shared_memory()
    handles = {n: shm.create_shared_memory_region(n, f"/{tag}_{n}", 128) for n in ("input_data", "output_data", "kept")}
    shm.set_shared_memory_region(handles["input_data"], [a])
    shm.set_shared_memory_region(handles["input_data"], [b], offset=64)
    for name in handles:
        client.register_system_shared_memory(name, f"/{tag}_{name}", 128)

    def simple(in_offset=0, out_size=64, region="input_data"):
        inputs = [tc.InferInput("INPUT0", [4, 4], "FP32"), tc.InferInput("INPUT1", [4, 4], "FP32")]
        inputs[0].set_shared_memory(region, 64, offset=in_offset)
        inputs[1].set_shared_memory("input_data", 64, offset=64)
        outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory("output_data", out_size)
        outputs[1].set_shared_memory("output_data", 64, offset=64)
        return client.infer("simple", inputs, outputs=outputs)

    result = simple()
    found = {}
    for name, offset in (("OUTPUT0", 0), ("OUTPUT1", 64)):
        meta = result.get_output(name)
        found[name] = {"values": shm.get_contents_as_numpy(handles["output_data"], triton_to_np_dtype(meta.datatype),
                                                           list(meta.shape), offset=offset).tolist(),
                       "region": meta.parameters["shared_memory_region"].string_param,
                       "byte_size": meta.parameters["shared_memory_byte_size"].int64_param,
                       "raw": len(result.get_response().raw_output_contents[int(name[-1])])}
    # mixed: INPUT1 sent in the request, OUTPUT1 answered in the response
    inputs = [tc.InferInput("INPUT0", [4, 4], "FP32"), tc.InferInput("INPUT1", [4, 4], "FP32")]
    inputs[0].set_shared_memory("input_data", 64)
    inputs[1].set_data_from_numpy(b * 4)
    outputs = [tc.InferRequestedOutput("OUTPUT0"), tc.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory("kept", 64, offset=32)
    mixed = client.infer("simple", inputs, outputs=outputs)
    found["mixed_output1"] = mixed.as_numpy("OUTPUT1").tolist()
    found["mixed_output0"] = shm.get_contents_as_numpy(handles["kept"], np.float32, [4, 4], offset=32).tolist()
    # strings: simple_grpc_shm_string_client.py
    words = np.array([b"shared", b"", b"memory"], dtype=object)
    framed = serialize_byte_tensor(words)
    strings = {n: shm.create_shared_memory_region(n, f"/{tag}_{n}", 64) for n in ("str_in", "str_out")}
    shm.set_shared_memory_region(strings["str_in"], [framed])
    for name in strings:
        client.register_system_shared_memory(name, f"/{tag}_{name}", 64)
    text = tc.InferInput("IN_BYTES", [1, 3], "BYTES")
    text.set_shared_memory("str_in", serialized_byte_size(framed))
    text_out = tc.InferRequestedOutput("OUT_BYTES")
    text_out.set_shared_memory("str_out", 64)
    meta = client.infer("strings", [text], outputs=[text_out]).get_output("OUT_BYTES")
    found["strings"] = [v.decode() for v in shm.get_contents_as_numpy(strings["str_out"], np.object_, [1, 3]).reshape(-1)]
    found["strings_byte_size"] = meta.parameters["shared_memory_byte_size"].int64_param
    found["status"] = sorted(client.get_system_shared_memory_status(as_json=True)["regions"].values(), key=lambda r: r["name"])
    found["one_status"] = client.get_system_shared_memory_status("kept", as_json=True)
    found["errors"] = {
        "twice": error(lambda: client.register_system_shared_memory("kept", f"/{tag}_kept", 128)),
        "no_key": error(lambda: client.register_system_shared_memory("nokey", f"/{tag}_never_created", 16)),
        "past_object": error(lambda: client.register_system_shared_memory("past", f"/{tag}_kept", 64, offset=100)),
        "too_small": error(lambda: simple(out_size=16)),
        "offset": error(lambda: simple(in_offset=128)),
        "offset_size": error(lambda: simple(in_offset=96)),
        "unknown_status": error(lambda: client.get_system_shared_memory_status("nope")),
        "cuda": error(lambda: client.get_cuda_shared_memory_status("c")),
        "cuda_register": error(lambda: client.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)),
    }
    client.unregister_system_shared_memory("input_data")
    found["errors"]["unregistered"] = error(lambda: simple())
    found["extensions"] = list(client.get_server_metadata().extensions)
    client.unregister_cuda_shared_memory("c")
    found["cuda_status"] = client.get_cuda_shared_memory_status(as_json=True)
    for name in ("output_data", "str_in", "str_out"):
        client.unregister_system_shared_memory(name)
    found["status_left"] = sorted(client.get_system_shared_memory_status(as_json=True).get("regions", {}))
    for handle in (*handles.values(), *strings.values()):
        shm.destroy_shared_memory_region(handle)
    return found


def shared_memory_clear(client) -> dict:
    client.unregister_system_shared_memory()
    return {"status_left": sorted(client.get_system_shared_memory_status(as_json=True).get("regions", {}))}


SCENARIOS = {"shared_memory": shared_memory, "shared_memory_clear": shared_memory_clear, "classification": classification, "model_control": model_control, "control_refused": control_refused}

if __name__ == "__main__":
    url, names = sys.argv[1], sys.argv[2:]
    with tc.InferenceServerClient(url) as client:
        print(json.dumps({name: SCENARIOS[name](client) for name in names}))
