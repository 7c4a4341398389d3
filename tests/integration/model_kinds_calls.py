"""Run by test_model_kinds.py in its own process (tritonclient's protobuf messages cannot share a
process with Ferry's): ensembles, a decoupled model and true python batching, as Triton users call them."""

import json
import queue
import sys

import numpy as np
import tritonclient.grpc as tc
from tritonclient_calls import error  # run as a script: its folder is on sys.path


def tensor(name, array, datatype):
    t = tc.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def ensembles(client) -> dict:
    raw = np.linspace(-3, 3, 32, dtype=np.float32).reshape(2, 16)
    whole = client.infer("pipeline", [tensor("RAW", raw, "FP32")]).as_numpy("RESULT")
    pre = client.infer("preprocess", [tensor("RAW", raw, "FP32")])
    mid = client.infer("simple", [tensor("INPUT0", pre.as_numpy("DOUBLED"), "FP32"),
                                  tensor("INPUT1", pre.as_numpy("SHIFTED"), "FP32")])
    post = client.infer("postprocess", [tensor("SUM", mid.as_numpy("OUTPUT0"), "FP32"),
                                        tensor("DIFF", mid.as_numpy("OUTPUT1"), "FP32")]).as_numpy("RESULT")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    chained = client.infer("chain", [tensor("IN", x, "FP32")]).as_numpy("OUT")
    bad = np.array([[1, -5, 1, 1]], np.float32)  # still negative after the first step (+1)
    # exact: the ensemble must pass the same tensors through the same element-wise steps
    return {"pipeline_equals_steps": bool(np.array_equal(whole, post)), "pipeline_shape": list(whole.shape),
            "chain": chained.tolist(), "chain_expected": ((x + 1) * 3 - 2).tolist(),
            "failing_step": error(lambda: client.infer("chain", [tensor("IN", bad, "FP32")])),
            "chain_after_failure": client.infer("chain", [tensor("IN", x, "FP32")]).as_numpy("OUT").tolist(),
            "metadata_platform": client.get_model_metadata("chain", as_json=True)["platform"]}


def repeat(client) -> dict:
    def inputs(values):
        values = np.array(values, np.int32)
        return [tensor("IN", values, "INT32"), tensor("DELAY", np.zeros(len(values), np.uint32), "UINT32"),
                tensor("WAIT", np.array([0], np.uint32), "UINT32")]

    received = queue.Queue()
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer("repeat_int32", inputs([4, 5, 6, 7]), request_id="r4", enable_empty_final_response=True)
    client.async_stream_infer("repeat_int32", inputs([9]), request_id="r1", enable_empty_final_response=True)
    responses = {"r4": [], "r1": []}
    finished = set()
    while len(finished) < 2:
        result, err = received.get(timeout=60)
        assert err is None, err
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if final:
            finished.add(response.id)
            responses[response.id].append({"final": True, "outputs": len(response.outputs)})
        else:
            responses[response.id].append({"final": False, "out": int(result.as_numpy("OUT")[0]),
                                           "idx": int(result.as_numpy("IDX")[0])})
    client.stop_stream()
    infer_error = error(lambda: client.infer("repeat_int32", inputs([1])))
    return {"responses": responses, "infer_error": infer_error}


def batching(client) -> dict:
    done = queue.Queue()
    for i in range(4):
        x = np.full((1, 4), i, np.float32)
        client.async_infer("rows", [tensor("X", x, "FP32")], callback=lambda result, error: done.put((result, error)))
    seen = []
    for _ in range(4):
        result, err = done.get(timeout=60)
        assert err is None, err
        seen.append((int(result.as_numpy("ROWS")[0, 0]), result.as_numpy("Y").tolist()))
    stats = client.get_inference_statistics("rows", as_json=True)["model_stats"][0]
    return {"rows_seen": sorted(r for r, _ in seen), "outputs": sorted(y[0][0] for _, y in seen),
            "execution_count": int(stats.get("execution_count", 0)), "inference_count": int(stats.get("inference_count", 0))}


def interleaved(client, model: str) -> dict:
    """Two sequences, one request of each in flight at a time: each round is one batch of both."""
    done = queue.Queue()
    answers = {1001: [], 1002: []}
    values = {1001: [1, 2, 3, 4], 1002: [10, 20, 30, 40]}
    for step in range(4):
        for cid in (1001, 1002):
            x = np.array([[values[cid][step]]], np.int32)
            client.async_infer(model, [tensor("INPUT", x, "INT32")], sequence_id=cid, sequence_start=step == 0,
                               sequence_end=step == 3, callback=lambda result, error: done.put((result, error)))
        for _ in range(2):
            result, err = done.get(timeout=60)
            assert err is None, err
            answers[int(result.as_numpy("CORR")[0, 0])].append(int(result.as_numpy("OUTPUT")[0, 0]))
    stats = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    return {"answers": {str(k): v for k, v in answers.items()}, "execution_count": int(stats["execution_count"]),
            "inference_count": int(stats["inference_count"]),
            "batch_sizes": sorted(int(b["batch_size"]) for b in stats.get("batch_stats", []))}


def string_ids(client) -> dict:
    answers = {}
    for cid, values in (("alpha", [5, 6]), ("beta", [100, 1])):
        for i, v in enumerate(values):
            result = client.infer("acc_string", [tensor("INPUT", np.array([[v]], np.int32), "INT32")], sequence_id=cid,
                                  sequence_start=i == 0, sequence_end=i == len(values) - 1)
            answers.setdefault(cid, []).append([int(result.as_numpy("OUTPUT")[0, 0]),
                                                result.as_numpy("CORR")[0, 0].decode()])
    no_start = error(lambda: client.infer("acc_string", [tensor("INPUT", np.array([[1]], np.int32), "INT32")],
                                          sequence_id="gamma"))
    no_id = error(lambda: client.infer("acc_string", [tensor("INPUT", np.array([[1]], np.int32), "INT32")]))
    return {"answers": answers, "no_start": no_start, "no_id": no_id}


if __name__ == "__main__":
    c = tc.InferenceServerClient(sys.argv[1])
    print(json.dumps({"ensembles": ensembles(c), "repeat": repeat(c), "batching": batching(c),
                      "direct": interleaved(c, "acc_direct"), "oldest": interleaved(c, "acc_oldest"),
                      "string_ids": string_ids(c)}))
