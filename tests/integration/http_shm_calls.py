"""Run by test_http_shared_memory.py in its own process (tritonclient's protobufs cannot share a process
with Ferry's): Triton's simple_http_shm_client.py and simple_http_shm_string_client.py flows with
tritonclient.http and tritonclient.utils.shared_memory, unchanged, then the health/metadata and
model-config reads of simple_http_health_metadata.py and image_client.py. Prints JSON.

usage: http_shm_calls.py URL TAG   (TAG prefixes every shared memory key, so parallel runs never clash)
"""

import json
import sys

import numpy as np
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient import utils
from tritonclient.utils import InferenceServerException


def error(fn):
    try:
        fn()
    except InferenceServerException as exc:
        return {"status": exc.status(), "message": exc.message()}
    return None


def shm_client(client, tag: str) -> dict:
    """simple_http_shm_client.py, step by step."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    input0_data = np.arange(start=0, stop=16, dtype=np.int32)
    input1_data = np.ones(shape=16, dtype=np.int32)
    input_byte_size = input0_data.size * input0_data.itemsize
    output_byte_size = input_byte_size
    shm_op_handle = shm.create_shared_memory_region("output_data", f"/{tag}_output_simple", output_byte_size * 2)
    client.register_system_shared_memory("output_data", f"/{tag}_output_simple", output_byte_size * 2)
    shm_ip_handle = shm.create_shared_memory_region("input_data", f"/{tag}_input_simple", input_byte_size * 2)
    shm.set_shared_memory_region(shm_ip_handle, [input0_data])
    shm.set_shared_memory_region(shm_ip_handle, [input1_data], offset=input_byte_size)
    client.register_system_shared_memory("input_data", f"/{tag}_input_simple", input_byte_size * 2)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32")]
    inputs[-1].set_shared_memory("input_data", input_byte_size)
    inputs.append(httpclient.InferInput("INPUT1", [1, 16], "INT32"))
    inputs[-1].set_shared_memory("input_data", input_byte_size, offset=input_byte_size)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    outputs[-1].set_shared_memory("output_data", output_byte_size)
    outputs.append(httpclient.InferRequestedOutput("OUTPUT1", binary_data=True))
    outputs[-1].set_shared_memory("output_data", output_byte_size, offset=output_byte_size)
    results = client.infer(model_name="simple", inputs=inputs, outputs=outputs)
    output0, output1 = results.get_output("OUTPUT0"), results.get_output("OUTPUT1")
    out = {"output0": output0, "output1": output1}
    out["sum"] = shm.get_contents_as_numpy(shm_op_handle, utils.triton_to_np_dtype(output0["datatype"]),
                                           output0["shape"]).tolist()
    out["difference"] = shm.get_contents_as_numpy(shm_op_handle, utils.triton_to_np_dtype(output1["datatype"]),
                                                  output1["shape"], offset=output_byte_size).tolist()
    out["status"] = client.get_system_shared_memory_status()
    out["one_status"] = client.get_system_shared_memory_status("input_data")
    out["errors"] = {
        "twice": error(lambda: client.register_system_shared_memory("input_data", f"/{tag}_input_simple", 64)),
        "no_key": error(lambda: client.register_system_shared_memory("nokey", f"/{tag}_never_created", 16)),
        "unknown_status": error(lambda: client.get_system_shared_memory_status("nope")),
        "cuda_register": error(lambda: client.register_cuda_shared_memory("c", b"\0" * 64, 0, 64)),
        "cuda_one_status": error(lambda: client.get_cuda_shared_memory_status("c")),
    }
    small = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True)]
    small[-1].set_shared_memory("output_data", 16)
    out["errors"]["too_small"] = error(lambda: client.infer("simple", inputs, outputs=small))
    client.unregister_system_shared_memory()
    out["status_after"] = client.get_system_shared_memory_status()
    out["errors"]["unregistered"] = error(lambda: client.infer("simple", inputs, outputs=outputs))
    out["cuda_status"] = client.get_cuda_shared_memory_status()
    out["mapped_before_destroy"] = len(shm.mapped_shared_memory_regions())
    shm.destroy_shared_memory_region(shm_ip_handle)
    shm.destroy_shared_memory_region(shm_op_handle)
    return out


def shm_string_client(client, tag: str) -> dict:
    """simple_http_shm_string_client.py, step by step."""
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()
    in0 = np.arange(start=0, stop=16, dtype=np.int32)
    input0_data = np.array([str(x).encode("utf-8") for x in in0.flatten()], dtype=object).reshape(in0.shape)
    in1 = np.ones(shape=16, dtype=np.int32)
    input1_data = np.array([str(x).encode("utf-8") for x in in1.flatten()], dtype=object).reshape(in1.shape)
    expected_sum = np.array([str(x).encode("utf-8") for x in np.add(in0, in1).flatten()], dtype=object)
    expected_diff = np.array([str(x).encode("utf-8") for x in np.subtract(in0, in1).flatten()], dtype=object)
    sizes = {name: utils.serialized_byte_size(utils.serialize_byte_tensor(data)) for name, data in
             (("input0_data", input0_data), ("input1_data", input1_data), ("output0_data", expected_sum),
              ("output1_data", expected_diff))}
    handles = {}
    for name in ("output0_data", "output1_data", "input0_data", "input1_data"):
        handles[name] = shm.create_shared_memory_region(name, f"/{tag}_{name}", sizes[name])
        if name.startswith("input"):
            data = input0_data if name == "input0_data" else input1_data
            shm.set_shared_memory_region(handles[name], [utils.serialize_byte_tensor(data)])
        client.register_system_shared_memory(name, f"/{tag}_{name}", sizes[name])
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "BYTES"), httpclient.InferInput("INPUT1", [1, 16], "BYTES")]
    inputs[0].set_shared_memory("input0_data", sizes["input0_data"])
    inputs[1].set_shared_memory("input1_data", sizes["input1_data"])
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory("output0_data", sizes["output0_data"])
    outputs[1].set_shared_memory("output1_data", sizes["output1_data"])
    results = client.infer(model_name="simple_string", inputs=inputs, outputs=outputs)
    found = {}
    for index, name in enumerate(("OUTPUT0", "OUTPUT1")):
        meta = results.get_output(name)
        data = shm.get_contents_as_numpy(handles[f"output{index}_data"], utils.triton_to_np_dtype(meta["datatype"]),
                                         meta["shape"])
        found[name] = [v.decode() for v in data.reshape(-1)]
    found["expected"] = [[v.decode() for v in expected_sum], [v.decode() for v in expected_diff]]
    client.unregister_system_shared_memory()
    for handle in handles.values():
        shm.destroy_shared_memory_region(handle)
    return found


def metadata_and_config(client) -> dict:
    """simple_http_health_metadata.py's server metadata; image_client.py's config read (max_batch_size)."""
    config = client.get_model_config("densenet_onnx")
    return {"server": client.get_server_metadata(), "max_batch_size": config.get("max_batch_size", "absent"),
            "dims": config["input"][0]["dims"], "config_keys": sorted(config)}


if __name__ == "__main__":
    url, tag = sys.argv[1], sys.argv[2]
    client = httpclient.InferenceServerClient(url=url)
    print(json.dumps({"shm": shm_client(client, tag), "strings": shm_string_client(client, tag),
                      "metadata": metadata_and_config(client)}))
