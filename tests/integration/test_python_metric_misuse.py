"""pb_utils metric misuse is refused with TritonModelException, the exception Triton's model code catches
(qa/python_models/custom_metrics): a counter that would decrease or be set, a gauge asked to observe,
a histogram metric without buckets or with buckets
not in strictly ascending order, a family
named as a live one of another kind, a histogram's value(). A second Metric with the same labels is the same metric. Anything else escaping would fail the request instead."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer

_CONFIG = """
backend: "python"
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "REFUSED", data_type: TYPE_INT32, dims: [ 1 ] },
         { name: "COUNT", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""

_MODEL = textwrap.dedent('''
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            Family = pb_utils.MetricFamily
            counter = Family("misuse_counter", "a counter", Family.COUNTER).Metric(labels={"k": "v"})
            gauge = Family("misuse_gauge", "a gauge", Family.GAUGE).Metric()
            histogram = Family("misuse_histogram", "a histogram", Family.HISTOGRAM)
            counter.increment(2.0)
            refused = 0
            for misuse in (lambda: counter.increment(-1.0), lambda: counter.set(5.0), lambda: gauge.observe(1.0),
                           lambda: histogram.Metric(labels={"k": "v"}), lambda: histogram.Metric(buckets=[2.5, 0.1, 1.0]),
                           lambda: histogram.Metric(buckets=[1, 1, 2]),
                           lambda: histogram.Metric(labels={"k": "h"}, buckets=[1.0]).value()):
                try:
                    misuse()
                except pb_utils.TritonModelException:
                    refused += 1
            histogram.Metric(labels={"k": "empty"}, buckets=[])  # no buckets but +Inf: Triton takes it
            try:
                Family("misuse_counter", "the same name, another kind", Family.GAUGE)
            except pb_utils.TritonModelException:
                refused += 1
            twin = Family("misuse_counter", "a counter", Family.COUNTER).Metric(labels={"k": "v"})
            twin.increment(1.5)  # the same family and labels: the same metric, as in Triton
            return [pb_utils.InferenceResponse([pb_utils.Tensor("REFUSED", np.array([refused], np.int32)),
                                                pb_utils.Tensor("COUNT", np.array([counter.value()], np.float32))])]
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "misuse" / "1").mkdir(parents=True)
    (repo / "misuse" / "config.pbtxt").write_text(_CONFIG)
    (repo / "misuse" / "1" / "model.py").write_text(_MODEL)
    running = RunningServer(repo)
    yield running
    running.stop()


def test_metric_misuse_raises_triton_model_exception_and_leaves_the_value(server):
    outputs = kserve.infer(server.channel, "misuse", {"X": np.array([1.0], np.float32)})
    assert outputs["REFUSED"].tolist() == [8]
    assert outputs["COUNT"].tolist() == [3.5]  # 2 + its twin's 1.5; the refused decrement changed nothing
