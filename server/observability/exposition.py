"""The /metrics page in Prometheus' text format, named as Triton names it.

prometheus_client's own renderer declares every counter family as `<name>_total`. Ferry's
Triton-named counters (`nv_inference_count`, no suffix, as Triton exposes them so dashboards keep
working) are sampled under their bare names, so that renderer declared `# TYPE nv_inference_count_total
counter` over `nv_inference_count` samples: strict parsers filed the samples as untyped and the
declared counter had none. Here a family's HELP/TYPE name is always the name its samples carry:
the bare name for metrics.BareCounter families (Triton's counters), `_total` for prometheus_client's
own Counter objects, whose samples carry the suffix.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.utils import floatToGoString

from server.observability.metrics import BareCounter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram"}


def render(registry: CollectorRegistry) -> bytes:
    lines = []
    for metric in registry.collect():
        name, kind = _declared(metric)
        lines.append(f"# HELP {name} {_escape_help(metric.documentation)}\n")
        lines.append(f"# TYPE {name} {_TYPES.get(kind, kind)}\n")
        for sample in metric.samples:
            if sample.name == metric.name + "_created":
                continue  # OpenMetrics-only series; app.py disables them, any left would break the family
            labels = ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(sample.labels.items()))
            lines.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n" if labels
                         else f"{sample.name} {floatToGoString(sample.value)}\n")
    return "".join(lines).encode()


def _declared(metric) -> tuple[str, str]:
    if metric.type == "counter":
        return (metric.name if isinstance(metric, BareCounter) else metric.name + "_total"), "counter"
    if metric.type == "info":
        return metric.name + "_info", "gauge"
    return metric.name, metric.type


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class MetricsServer:
    """GET /metrics on a daemon thread (the scrape reads ModelStats under their own locks)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # http.server calls it by this name
                if self.path.split("?")[0] not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served here")
                    return
                body = render(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # one line per scrape would drown the server's log
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        self._http = Server((host, port), Handler)  # OSError when the port is taken (app.py reports it)
        self._http.daemon_threads = True
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()

    def shutdown(self) -> None:
        self._http.shutdown()
        self._http.server_close()
