"""A batch's observations recorded at once land in the same buckets, count and sum as one by one."""

from prometheus_client import CollectorRegistry, Histogram

from server.observability.metrics import observe_all

BUCKETS = (100, 250, 500, 1_000)


def _samples(registry: CollectorRegistry) -> dict:
    return {(s.name, s.labels.get("le")): s.value for m in registry.collect() for s in m.samples
            if not s.name.endswith("_created")}


def test_observe_all_matches_observe_one_by_one():
    values = [0.0, 99.9, 100.0, 100.1, 250.0, 499.0, 1_000.0, 1_000.5, 7e9, 42.0, 42.0]
    one, many = CollectorRegistry(), CollectorRegistry()
    h_one = Histogram("h", "doc", ["model"], buckets=BUCKETS, registry=one).labels(model="m")
    h_many = Histogram("h", "doc", ["model"], buckets=BUCKETS, registry=many).labels(model="m")
    for v in values:
        h_one.observe(v)
    observe_all(h_many, values[:4])
    observe_all(h_many, values[4:])
    assert _samples(many) == _samples(one)
    assert _samples(one)[("h_bucket", "100.0")] == 5  # bounds are inclusive, as observe() has them
