"""When a free instance of a model that does not batch waits a moment for a longer train.

A train (server/runners/batch.py `_train`) sends the requests of such a model that queued while its
process ran one together, each still its own execute: the whole train costs the event loop one dispatch,
one frame and one answer hop, where each request alone paid all three. On a light model at many
clients the loop, not the model, is the bottleneck, and there it is the loop that decides how long trains
get: it brings in about one call a turn, so when the instance frees, the queue holds 0-1 requests and
every request pays the hop alone (add_sub at 64 clients: ~475 us of loop time a request plus ~215 us
a dispatch). Holding the free instance for a few milliseconds lets the loop take in the calls already
waiting in gRPC, and the train that leaves carries them all.

It only pays, and so it only holds, when
- the loop is the bottleneck: its busy share (server/observability/loop_load.py) is at least the same
  0.85 from which the adaptive window counts the front end as the bottleneck. A server with cores to
  spare answers a lone request at once;
- more requests are coming: the model's mean arrival gap is shorter than what is left of the hold, and
  its clients are several: by Little's law, its arrival rate times the time its requests spend in the
  server (arrival to answer) is at least 2. A lone client's next request comes only once this one is
  answered, however short its gap (that product is under 1 then): it is never held. Counting what is
  queued would not tell them apart: with the loop the bottleneck, a crowd's requests wait in gRPC, not
  in the model's queue;
- the instance has time to spare: its executes, at the arrival rate, fill under half of its time, so
  idling it does not cost requests it could have run;
- no queued request's deadline falls inside the hold.

It ends as soon as the train is full or the hold's time is up. The hold is bounded by the model's
`FERRY_TRAIN_HOLD_US` (parameters); 0 turns it off.
"""

from __future__ import annotations

FRONTEND_BUSY = 0.85  # as the adaptive window's front-end rule (server/scheduling/adaptive.py)
MAX_INSTANCE_LOAD = 0.5  # executes may fill at most this share of the instance's time
_ALPHA = 0.1  # weight of the newest arrival (or answered batch) in the means
MIN_CONCURRENCY = 2.0  # the model's requests in the server at once, on average (rate x time in server)


class TrainHold:
    def __init__(self, max_hold_ns: int):
        self.max_hold_ns = max_hold_ns
        self.gap_ns: float | None = None  # mean time between arrivals (None: fewer than two seen)
        self._last_arrival_ns: int | None = None
        self.latency_ns: float | None = None  # mean time from a request's arrival to its answer
        self._since_ns: int | None = None  # when the free instance began to wait (None: it does not)
        self.until_ns: int | None = None  # when the hold in force ends (None: none)
        self.limit = 0  # the train the hold in force waits to fill

    def on_arrival(self, now_ns: int) -> None:
        last, self._last_arrival_ns = self._last_arrival_ns, now_ns
        if last is not None:
            gap = now_ns - last
            self.gap_ns = gap if self.gap_ns is None else self.gap_ns + _ALPHA * (gap - self.gap_ns)

    def on_answered(self, totals_ns: list[int]) -> None:
        """A batch's requests answered, each `total` after its arrival."""
        if totals_ns:
            mean = sum(totals_ns) / len(totals_ns)
            self.latency_ns = mean if self.latency_ns is None else self.latency_ns + _ALPHA * (mean - self.latency_ns)

    @property
    def concurrency(self) -> float:
        """The model's requests in the server at once, on average (0 until both means are known)."""
        return self.latency_ns / self.gap_ns if self.gap_ns and self.latency_ns is not None else 0.0

    def holds(self, now_ns: int, queued: int, limit: int, busy: float | None, execute_ns: int,
              next_deadline_ns: int | None) -> bool:
        """Whether the free instance waits now rather than take a train of `queued` (< `limit`); while
        it does, `until_ns` says until when. Every call that answers False ends the hold."""
        since = self._since_ns if self._since_ns is not None else now_ns
        until = since + self.max_hold_ns
        gap = self.gap_ns
        if (0 < queued < limit and busy is not None and busy >= FRONTEND_BUSY and gap is not None
                and gap < until - now_ns and self.concurrency >= MIN_CONCURRENCY and execute_ns < MAX_INSTANCE_LOAD * gap
                and (next_deadline_ns is None or next_deadline_ns > until)):
            self._since_ns, self.until_ns, self.limit = since, until, limit
            return True
        self._since_ns = self.until_ns = None
        return False

    def waits_for(self, queued: int, deadline_ns: int | None) -> bool:
        """Whether an arrival that leaves `queued` waiting (its deadline `deadline_ns`) changes nothing for
        the hold in force: the train is not full yet, and the deadline is after the hold's end. The
        runner then takes no turn for it: the hold's timer, or the arrival that fills the train, does."""
        return self.until_ns is not None and queued < self.limit and (deadline_ns is None or deadline_ns > self.until_ns)
