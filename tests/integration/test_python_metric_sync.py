"""A pb_utils metric update is visible on /metrics once the call returns, as in Triton (whose stub waits
for its server): Triton's custom_metrics tests set a gauge and read the server's /metrics page from the
model right after. The model here does the same, many times, and answers what the page said."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from tests import kserve
from tests.conftest import RunningServer

_CONFIG = """
backend: "python"
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] }, { name: "URL", data_type: TYPE_STRING, dims: [ 1 ] } ]
output [ { name: "SEEN", data_type: TYPE_FP32, dims: [ 1 ] } ]
"""

_MODEL = textwrap.dedent('''
    import re
    import urllib.request

    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            family = pb_utils.MetricFamily("sync_gauge", "set, then read back", pb_utils.MetricFamily.GAUGE)
            self.gauge = family.Metric(labels={"k": "v"})

        def execute(self, requests):
            out = []
            for request in requests:
                x = float(pb_utils.get_input_tensor_by_name(request, "X").as_numpy()[0])
                url = pb_utils.get_input_tensor_by_name(request, "URL").as_numpy()[0].decode()
                self.gauge.set(x)
                page = urllib.request.urlopen(url, timeout=10).read().decode()
                seen = float(re.search(r'^sync_gauge\\{k="v"\\} (\\S+)$', page, re.M).group(1))
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", np.array([seen], np.float32))]))
            return out
''')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    (repo / "sync" / "1").mkdir(parents=True)
    (repo / "sync" / "1" / "model.py").write_text(_MODEL)
    (repo / "sync" / "config.pbtxt").write_text(_CONFIG)
    running = RunningServer(repo)
    yield running
    running.stop()


def test_a_gauge_set_is_on_the_metrics_page_when_set_returns(server):
    url = np.array([server.metrics_url.encode()], np.object_)
    for i in range(40):  # each read follows its own update at once: any reordering shows the previous value
        out = kserve.infer(server.channel, "sync", {"X": np.array([float(i + 1)], np.float32), "URL": url})
        assert out["SEEN"].tolist() == [float(i + 1)], f"read {out['SEEN'].tolist()} right after setting {i + 1}"
