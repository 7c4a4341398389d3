"""A decoupled Triton-API Python model with dynamic batching gets the requests waiting for its instance
in one execute, as Triton's dynamic batcher gives them: up to max_batch_size rows of requests that can
be joined (the same shapes past dim 0), in arrival order, each answered through its own response sender
to its own caller; a request that fails fails alone; one whose caller left while it waited never runs;
max_queue_delay_microseconds holds a batch that is not full while the instance is free; a full queue
(default_queue_policy.max_queue_size) refuses the next request and serves the rest; a request whose
`timeout` passes while it waits ends with its deadline, never running; a higher priority level runs
first. A
decoupled stateful model (sequence_batching) gets Triton's control inputs, and each sequence's requests
run in order on one instance, one per execute."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from protos import grpc_service_pb2 as pb
from tests import kserve, python_decoupled_batching_models
from tests.conftest import RunningServer, wait_for


class Stream:
    """One request on a ModelStreamInfer call of its own (kept open, as tritonclient keeps its stream),
    its responses collected by a thread: outputs, ("error", message) or ("rpc", status)."""

    def __init__(self, server: RunningServer, model: str, x: list[list[int]], timeout_us: int = 0, priority: int = 0):
        self.items: list = []
        self._close = threading.Event()
        request = kserve.request(model, {"X": np.array(x, np.int32)})
        if timeout_us:
            request.parameters["timeout"].int64_param = timeout_us
        if priority:
            request.parameters["priority"].int64_param = priority

        def requests():
            yield request
            self._close.wait(300)

        self.call = kserve.stub(server.channel).ModelStreamInfer(requests())
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.items.append(("error", response.error_message) if response.error_message
                                  else {k: v.tolist() for k, v in kserve.outputs(response.infer_response).items()})
        except grpc.RpcError as exc:
            self.items.append(("rpc", exc.code()))

    def first(self):
        wait_for(lambda: self.items, 120, "the stream's first response")
        return self.items[0]

    def close(self) -> None:
        self._close.set()


def statistics(server: RunningServer, model: str):
    return kserve.stub(server.channel).ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=30).model_stats[0]


def pending(server: RunningServer, model: str) -> float | None:
    return server.metric("nv_inference_pending_request_count", model=model)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    gate, entered = repo.parent / "tbatched.gate", repo.parent / "tbatched.entered"
    python_decoupled_batching_models.build(repo, gate, entered)
    server = RunningServer(repo)
    streams: list[Stream] = []
    try:
        yield server, gate, entered, streams
    finally:
        gate.touch()  # whatever failed, nothing stays held
        (repo.parent / "tqueue.gate").touch()
        (repo.parent / "tprio.gate").touch()
        for stream in streams:
            stream.close()
        server.stop()


def test_waiting_requests_run_in_one_execute_each_answered_alone(served):
    server, gate, entered, streams = served

    def send(x: list[list[int]]) -> Stream:
        before = pending(server, "tbatched") or 0
        stream = Stream(server, "tbatched", x)
        streams.append(stream)
        wait_for(lambda: pending(server, "tbatched") == before + 1, 60, f"request {x} to be queued")
        return stream

    a = Stream(server, "tbatched", [[1]])  # waits out its 50 ms window (the instance is free), then runs alone
    streams.append(a)
    wait_for(entered.exists, 60, "tbatched to be running A")
    b, c, h = send([[2]]), send([[3]]), send([[99]])
    h.call.cancel()  # its caller leaves while it waits: it never runs, and the batch takes the next one instead
    wait_for(lambda: pending(server, "tbatched") == 2, 60, "the cancelled request to leave the queue")
    d, e, f, g = send([[-4]]), send([[5, 5]]), send([[6]]), send([[7]])
    gate.touch()

    assert a.first() == {"Y": [[10]], "BATCH": [[1]]}
    # B, C, D and F can be joined (shape [1, 1]) and fill max_batch_size 4; E ([1, 2]) cannot, and runs
    # next, alone; G after it. D's error response fails D alone.
    assert [s.first() for s in (b, c, f)] == [{"Y": [[20]], "BATCH": [[4]]}, {"Y": [[30]], "BATCH": [[4]]},
                                              {"Y": [[60]], "BATCH": [[4]]}]
    assert d.first() == ("error", "X must not be negative")
    assert e.first() == {"Y": [[50, 50]], "BATCH": [[1]]}
    assert g.first() == {"Y": [[70]], "BATCH": [[1]]}
    assert h.first() == ("rpc", grpc.StatusCode.CANCELLED)
    seen = Stream(server, "tbatched", [[0]])
    streams.append(seen)
    assert seen.first()["Y"] == [[1, 2, 3, -4, 6, 5, 5, 7]]  # in the order the executes got them; 99 never ran
    assert all(len(s.items) == 1 for s in (a, b, c, d, e, f, g))  # one response each, to its own caller

    # counted when each execute has returned, which the server may hear just after the last response
    wait_for(lambda: statistics(server, "tbatched").execution_count == 5, 60, "the last execute to be counted")
    stats = statistics(server, "tbatched")
    assert (stats.execution_count, stats.inference_count) == (5, 8)  # A, BCDF, E, G, the SEEN request
    assert {b.batch_size: b.compute_infer.count for b in stats.batch_stats} == {1: 4, 4: 1}


def test_a_batch_that_is_not_full_waits_its_queue_delay_while_the_instance_is_free(served):
    server, _, _, streams = served
    first = Stream(server, "tpair", [[1]])
    streams.append(first)
    wait_for(lambda: pending(server, "tpair") == 1, 60, "the first request to wait for its batch")
    second = Stream(server, "tpair", [[2]])
    streams.append(second)
    assert [first.first(), second.first()] == [{"Y": [[10]], "BATCH": [[2]]}, {"Y": [[20]], "BATCH": [[2]]}]


def test_a_full_queue_refuses_the_next_request_and_a_timed_out_one_leaves_it_and_the_others_are_served(served):
    server, gate, _, streams = served
    tqueue_gate, tqueue_entered = gate.with_name("tqueue.gate"), gate.with_name("tqueue.entered")
    running = Stream(server, "tqueue", [[1]])
    streams.append(running)
    wait_for(tqueue_entered.exists, 60, "tqueue to be running the first request")
    # the instance is held at the gate, so this request's timeout passes in the queue however slow the machine
    timed = Stream(server, "tqueue", [[9]], timeout_us=50_000)
    streams.append(timed)
    item = timed.first()
    assert item[0] == "error" and "its deadline passed before it could run" in item[1]
    queued = Stream(server, "tqueue", [[2]])
    streams.append(queued)
    wait_for(lambda: pending(server, "tqueue") == 1, 60, "the second request to be queued")
    refused = Stream(server, "tqueue", [[3]])
    streams.append(refused)
    item = refused.first()
    assert item[0] == "error" and "request queue for priority level 1 is full (max_queue_size 1)" in item[1]
    tqueue_gate.touch()
    assert [running.first(), queued.first()] == [{"Y": [[10]], "BATCH": [[1]]}, {"Y": [[20]], "BATCH": [[1]]}]
    def counts() -> tuple[int, int]:  # a stream is counted once it has ended, just after its last response
        stats = statistics(server, "tqueue").inference_stats
        return stats.success.count, stats.fail.count

    wait_for(lambda: counts() == (2, 2), 60, "both answered and both refused requests to be counted")
    assert pending(server, "tqueue") == 0


def test_a_higher_priority_request_runs_before_those_waiting_at_lower_levels(served):
    server, gate, _, streams = served
    tprio_gate, tprio_entered = gate.with_name("tprio.gate"), gate.with_name("tprio.entered")

    def send(x: int, priority: int = 0) -> Stream:
        before = pending(server, "tprio") or 0
        stream = Stream(server, "tprio", [[x]], priority=priority)
        streams.append(stream)
        wait_for(lambda: pending(server, "tprio") == before + 1, 60, f"request {x} to be queued")
        return stream

    held = Stream(server, "tprio", [[4]])
    streams.append(held)
    wait_for(tprio_entered.exists, 60, "tprio to be running the first request")
    low = [send(1), send(2, priority=2)]  # the default level is 2
    high = send(3, priority=1)
    tprio_gate.touch()
    assert [s.first()["Y"] for s in [held, *low, high]] == [[[40]], [[10]], [[20]], [[30]]]
    seen = Stream(server, "tprio", [[0]])
    streams.append(seen)
    assert seen.first()["Y"] == [[4, 3, 1, 2]]  # level 1 first, then level 2 in arrival order


def sequence_stream(server: RunningServer, cid: int | None, count: int, model: str = "tseq_stream",
                    start: bool = True, end: bool = True) -> list:
    """`count` requests of sequence `cid` sent at once on one ModelStreamInfer stream (START on the first,
    END on the last, unless told not to; no sequence parameters when cid is None); their responses (an
    output row or an error message), in order."""
    requests = []
    for i in range(count):
        request = kserve.request(model, {"IN": np.array([[i]], np.int32)})
        if cid is not None:
            request.parameters["sequence_id"].int64_param = cid
            request.parameters["sequence_start"].bool_param = start and i == 0
            request.parameters["sequence_end"].bool_param = end and i == count - 1
        requests.append(request)
    answers = []
    for response in kserve.stub(server.channel).ModelStreamInfer(iter(requests), timeout=120):
        answers.append(response.error_message or kserve.outputs(response.infer_response)["OUT"][0].tolist())
        if len(answers) == count:
            break
    return answers


def test_a_stateful_decoupled_model_gets_control_inputs_and_each_sequence_stays_on_one_instance(served):
    server, _, _, _ = served
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda c=cid: results.__setitem__(c, sequence_stream(server, c, 4)))
               for cid in (11, 12, 13)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    for cid in (11, 12, 13):
        answers = results[cid]
        # START on the first only, END on the last only, READY always, CORRID the sequence's; counted 1..4 in
        # one instance (one process), in order
        assert [a[:5] for a in answers] == [[1, 0, 1, cid, 1], [0, 0, 1, cid, 2], [0, 0, 1, cid, 3], [0, 1, 1, cid, 4]]
        assert len({a[5] for a in answers}) == 1
        assert all(1 <= a[6] <= 2 for a in answers)  # never more than max_batch_size
    missing = sequence_stream(server, None, 1)
    assert "must specify a non-zero or non-empty correlation ID" in missing[0]


def test_a_stateful_decoupled_model_refuses_a_sequence_that_is_not_live_and_releases_an_idle_one(served):
    """As Triton's sequence batcher: a request of a sequence never started, or one sent after its END, is
    refused (INVALID_ARGUMENT, on the stream) without reaching the model; a sequence idle past
    max_sequence_idle_microseconds (unset: Triton's one second) is released, and must START again."""
    server, _, _, _ = served
    never = sequence_stream(server, 31, 1, "tseq_idle", start=False)
    assert "must specify the START flag" in never[0] and "31" in never[0]
    # START, -, END on one stream, then a late-comer after the END: refused, the three served in order
    answers = sequence_stream(server, 32, 3, "tseq_idle")
    assert [a[:2] for a in answers] == [[1, 0], [0, 0], [0, 1]]
    late = sequence_stream(server, 32, 1, "tseq_idle", start=False, end=False)
    assert "must specify the START flag" in late[0]
    # a late-comer queued behind the END on the same stream: refused once the END is taken to run, counted as
    # a failure that is not the model's
    other = server.metric("nv_inference_request_failure", model="tseq_idle", reason="OTHER") or 0
    requests = []
    for i, (start, end) in enumerate(((True, False), (False, True), (False, False))):
        request = kserve.request("tseq_idle", {"IN": np.array([[i]], np.int32)})
        request.parameters["sequence_id"].int64_param = 34
        request.parameters["sequence_start"].bool_param = start
        request.parameters["sequence_end"].bool_param = end
        requests.append(request)
    answers = []
    for response in kserve.stub(server.channel).ModelStreamInfer(iter(requests), timeout=120):
        answers.append(response.error_message or kserve.outputs(response.infer_response)["OUT"][0].tolist())
        if len(answers) == 3:
            break
    # (on the stream in the order they end: the refusal comes while the END still runs)
    errors = [a for a in answers if isinstance(a, str)]
    assert sorted(a[:2] for a in answers if not isinstance(a, str)) == [[0, 1], [1, 0]]
    assert len(errors) == 1 and "must specify the START flag" in errors[0]
    wait_for(lambda: server.metric("nv_inference_request_failure", model="tseq_idle", reason="OTHER") == other + 1, 60,
             "the late-comer counted as a failure of reason OTHER")
    assert not server.metric("nv_inference_request_failure", model="tseq_idle", reason="BACKEND")
    # left open (no END; both requests sent at once, so it is never idle between them); then it idles and is
    # released
    assert [a[:2] for a in sequence_stream(server, 33, 2, "tseq_idle", end=False)] == [[1, 0], [0, 0]]
    wait_for(lambda: "sequence 33 released after 1.000 s idle" in server.output, 60, "the idle release's log line")
    released = sequence_stream(server, 33, 1, "tseq_idle", start=False)
    assert "must specify the START flag" in released[0]
    assert sequence_stream(server, 33, 1, "tseq_idle")[0][:2] == [1, 1]  # started again: served
