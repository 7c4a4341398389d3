"""Run by test_python_rescheduling.py in its own process (tritonclient's protobuf messages cannot share
a process with Ferry's): the models of tests/python_rescheduling_models.py, called with tritonclient
(gRPC unary and streaming) and Triton's HTTP generate_stream, as Triton users call them. Prints JSON.

Arguments: gRPC address, HTTP address, metrics URL, the gate file tsteps waits for, the file it marks when
entered."""

import json
import queue
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
from tritonclient_calls import error  # run as a script: its folder is on sys.path


def tensor(name, array, datatype):
    t = tc.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def wait_for(check, what: str, timeout_s: float = 120) -> None:
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise TimeoutError(f"waited {timeout_s} s for {what}")
        time.sleep(0.01)


def pending(metrics: str, model: str) -> float:
    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("nv_inference_pending_request_count{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def steps(url: str, metrics: str, gate: Path, entered: Path) -> dict:
    """A (3 runs) holds the instance at the closed gate; B (2) and C (4) queue behind it; then the gate
    opens and the three go on, rescheduled, until each has had its runs."""
    results = {}

    def call(key: str, n: int) -> None:
        client = tc.InferenceServerClient(url)
        try:
            r = client.infer("tsteps", [tensor("N", np.array([[n]], np.int32), "INT32")])
            results[key] = {name: r.as_numpy(name)[0].tolist() for name in ("RUNS", "FLAGS", "BATCH", "CID")}
            results[key].update({name: results[key][name][0] for name in ("RUNS", "BATCH", "CID")})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[key] = {"error": str(exc)}

    first = threading.Thread(target=call, args=("a", 3))
    first.start()
    wait_for(entered.exists, "tsteps to be running A's first execute")
    others = [threading.Thread(target=call, args=(key, n)) for key, n in (("b", 2), ("c", 4))]
    for t in others:
        t.start()
    wait_for(lambda: pending(metrics, "tsteps") == 2, "B and C to be queued behind A")
    gate.touch()
    for t in [first, *others]:
        t.join(120)
    return results


def count_streams(url: str) -> dict:
    """Two requests on one stream: each gets its own count down, and START only on its first run."""
    received = queue.Queue()
    client = tc.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    for request_id, n in (("three", 3), ("two", 2)):
        client.async_stream_infer("tcount", [tensor("IN", np.array([n], np.int32), "INT32")], request_id=request_id)
    out, errors = {"three": [], "two": []}, []
    while sum(len(v) for v in out.values()) < 5 and not errors:
        result, err = received.get(timeout=60)
        if err is not None:
            errors.append(str(err))
            continue
        rid = result.get_response().id
        out[rid].append([int(result.as_numpy("OUT")[0]), int(result.as_numpy("FLAGS")[0])])
    client.stop_stream()
    return {"out": out, "errors": errors}


def generate_stream(http: str) -> list:
    """Triton's HTTP generate_stream (server-sent events), as the qa test of iterative sequences reads it."""
    request = urllib.request.Request(f"http://{http}/v2/models/tcount/generate_stream", json.dumps({"IN": 2}).encode(),
                                     {"Content-Type": "application/json", "Accept": "text/event-stream"})
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
    return events


def refused_stream(url: str) -> dict:
    received = queue.Queue()
    client = tc.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    client.async_stream_infer("tplain_stream", [tensor("IN", np.array([-3], np.int32), "INT32")])
    out, errors = [], []
    while not errors and len(out) < 5:
        result, err = received.get(timeout=60)
        if err is not None:
            errors.append(str(err))
        else:
            out.append(result.as_numpy("OUT").tolist())
    client.stop_stream()
    return {"out": out, "errors": errors}


def sequence(url: str) -> list:
    client = tc.InferenceServerClient(url)
    answers = []
    for start, end in ((True, False), (False, False), (False, True)):
        r = client.infer("tseq", [tensor("IN", np.array([[1]], np.int32), "INT32")], sequence_id=42,
                         sequence_start=start, sequence_end=end)
        answers.append([int(r.as_numpy(name)[0][0]) for name in ("CID", "FLAGS", "SEEN")])
    return answers


def threaded(url: str, model: str = "tthreaded") -> dict:
    """A's execute returns at once, its thread waiting for B; B is sent once A has answered its first."""
    received = queue.Queue()
    client = tc.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: received.put((result, error)))
    out, finals, errors = {"a": [], "b": []}, 0, []

    def take() -> None:
        nonlocal finals
        result, err = received.get(timeout=120)
        if err is not None:
            errors.append(str(err))
            return
        response = result.get_response()
        if result.as_numpy("OUT") is not None:  # not the empty final response
            out[response.id].append(int(result.as_numpy("OUT")[0]))
        finals += response.parameters["triton_final_response"].bool_param

    client.async_stream_infer(model, [tensor("ROLE", np.array([0], np.int32), "INT32")], request_id="a",
                              enable_empty_final_response=True)
    take()  # A has run (its execute returned; its thread waits)
    client.async_stream_infer(model, [tensor("ROLE", np.array([1], np.int32), "INT32")], request_id="b",
                              enable_empty_final_response=True)
    while finals < 2 and not errors:
        take()
    client.stop_stream()
    return {"out": out, "errors": errors}


def main(url: str, http: str, metrics: str, gate: str, entered: str) -> None:
    client = tc.InferenceServerClient(url)
    out = {"steps": steps(url, metrics, Path(gate), Path(entered))}
    out["steps_again"] = client.infer("tsteps", [tensor("N", np.array([[5]], np.int32), "INT32")]).as_numpy("RUNS").tolist()
    out["count"] = count_streams(url)
    out["generate_stream"] = generate_stream(http)
    out["refused"] = error(lambda: client.infer("tplain", [tensor("IN", np.array([[-1]], np.int32), "INT32")]))
    out["plain_after"] = client.infer("tplain", [tensor("IN", np.array([[4]], np.int32), "INT32")]).as_numpy("OUT").tolist()
    out["refused_stream"] = refused_stream(url)
    out["sequence"] = sequence(url)
    out["threaded"] = threaded(url)
    out["async"] = threaded(url, "tasync")
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:6])
