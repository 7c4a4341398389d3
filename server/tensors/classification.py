"""Triton's classification extension: a requested output answered as its top-k classes.

A client asks with the output parameter `classification: k`; the answer is a BYTES tensor of
"score:index" or "score:index:label" strings (Triton's format, the score as C's %f), highest score
first, shaped [k] (or [batch, k] for a batching model). Labels come from the output's
`label_filename`, a file in the model folder with one label per line, read once at load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from protos import model_config_pb2 as mc
from server.errors import ConfigError, InvalidInputError
from server.names import shown


def read_labels(config: mc.ModelConfig, model_dir: Path, source: str) -> dict[str, tuple[str, ...]]:
    """Output name -> labels, for every output whose config names a label_filename."""
    labels = {}
    for i, output in enumerate(config.output):
        if not output.label_filename:
            continue
        path = model_dir / output.label_filename
        if Path(output.label_filename).is_absolute() or ".." in Path(output.label_filename).parts or not path.is_file():
            raise ConfigError(f"{source}: field 'output[{i}].label_filename' names {output.label_filename!r}, "
                              f"which is not a file in the model folder {model_dir.name}/")
        labels[output.name] = tuple(path.read_text(errors="replace").splitlines())
    return labels


def classify(name: str, value: np.ndarray, k: int, labels: tuple[str, ...], batching: bool) -> np.ndarray:
    """The top `k` classes of `value` (per row when batching) as Triton's "score:index:label" bytes."""
    if value.dtype.kind not in "biuf":
        raise InvalidInputError(f"output {shown(name)} is {value.dtype} and cannot be classified; "
                                "the classification parameter needs a numeric output")
    rows = value.reshape(value.shape[0], -1) if batching else value.reshape(1, -1)
    k = min(k, rows.shape[1])
    top = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :k]  # [rows, k]
    scores = np.take_along_axis(rows, top, axis=1)
    out = np.empty(top.shape, dtype=object)
    for r in range(top.shape[0]):  # k strings per row: the answer itself is per element
        for j in range(k):
            index = int(top[r, j])
            label = labels[index] if index < len(labels) else ""
            text = f"{float(scores[r, j]):f}:{index}" + (f":{label}" if label else "")
            out[r, j] = text.encode()
    return out if batching else out[0]


def requested_k(name: str, value) -> int:
    """The `classification` parameter's class count, refused unless a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(f"output {shown(name)}: parameter 'classification' must be a positive integer "
                                f"(the number of classes), got {value!r}")
    return value
