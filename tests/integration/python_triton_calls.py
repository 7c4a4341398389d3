"""Run by test_python_triton_api.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): the Triton-API Python models of tests/python_triton_models.py, called as Triton
users call them. Prints JSON."""

import json
import queue
import sys
import threading

import numpy as np
import tritonclient.grpc as tc
from tritonclient_calls import error  # run as a script: its folder is on sys.path


def tensor(name, array, datatype):
    t = tc.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def add_inputs(first: float):
    a = np.array([[first, 1, 2, 3]], np.float32)
    return [tensor("INPUT0", a, "FP32"), tensor("INPUT1", np.ones((1, 4), np.float32), "FP32")]


def batch_of_three(client) -> dict:
    """Three requests meet in one execute (preferred size 3, a long window); the negative one fails alone."""
    results = {}

    def call(key, first, **kwargs):
        try:
            r = client.infer("tadd3", add_inputs(first), **kwargs)
            results[key] = {"sum": r.as_numpy("SUM").tolist(), "info": json.loads(r.as_numpy("INFO")[0][0])}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[key] = {"status": exc.status(), "message": exc.message()}

    outputs = [tc.InferRequestedOutput("SUM"), tc.InferRequestedOutput("INFO")]
    threads = [threading.Thread(target=call, args=("good", 1.0), kwargs={
                   "request_id": "r-good", "parameters": {"color": "red"}, "outputs": outputs}),
               threading.Thread(target=call, args=("other", 2.0)),
               threading.Thread(target=call, args=("bad", -1.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def stream(client, model, inputs, cancel_after=None) -> dict:
    received = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer(model, inputs, request_id="s1", enable_empty_final_response=True)
    out, finals, errors = [], 0, []
    while True:
        result, err = received.get(timeout=60)
        if err is not None:
            errors.append(str(err))
            break
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if result.as_numpy("OUT") is not None:
            out.append(result.as_numpy("OUT").tolist() + (result.as_numpy("IDX").tolist() if model == "trepeat" else []))
        finals += final
        if final:
            break
        if cancel_after is not None and len(out) >= cancel_after:
            break
    client.stop_stream(cancel_requests=cancel_after is not None)
    return {"out": out, "finals": finals, "errors": errors}


def main(url: str) -> None:
    client = tc.InferenceServerClient(url)
    out = {"batch": batch_of_three(client)}
    out["raised"] = error(lambda: client.infer("tadd", add_inputs(99.0)))
    out["after_raise"] = client.infer("tadd", add_inputs(0.0)).as_numpy("SUM").tolist()
    out["repeat"] = stream(client, "trepeat", [tensor("IN", np.array([4, 5, 6], np.int32), "INT32")])
    out["wait"] = stream(tc.InferenceServerClient(url), "twait", [tensor("IN", np.array([1], np.int32), "INT32")],
                         cancel_after=1)
    a, b = np.array([[1, 2, 3, 4]], np.float32), np.full((1, 4), 10, np.float32)
    bls = client.infer("tbls", [tensor("INPUT0", a, "FP32"), tensor("INPUT1", b, "FP32")])
    out["bls"] = {name: bls.as_numpy(name).tolist() for name in ("SUM", "TWICE", "STREAM", "MISSING_CODE", "READY")}
    out["bls"]["MISSING"] = bls.as_numpy("MISSING")[0].decode()
    out["bls"]["GPU"] = [bls.as_numpy("GPU")[0].decode()]
    out["auto_config"] = client.get_model_config("tauto", as_json=True)["config"]
    out["auto"] = client.infer("tauto", [tensor("X", np.array([[1, 2]], np.float32), "FP32")]).as_numpy("Y").tolist()
    out["metrics"] = [client.infer("tmetrics", [tensor("X", np.array([x], np.float32), "FP32")]).as_numpy("Y").tolist()
                      for x in (0.5, 5.0, 50.0)]
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
