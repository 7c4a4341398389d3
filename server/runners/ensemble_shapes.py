"""Adding or stripping the batch dimension where an ensemble's tensor crosses between a batching and a
non-batching model, as Triton's ensemble scheduler does.

Every tensor an ensemble holds remembers the rows of the request that made it: the batch size for a
tensor from a batching model (or a batching ensemble's own request), 0 for one from a non-batching
model. A tensor moving to a model that batches differently is fitted to the dims that model declares:
one without a batch dimension that matches the declared dims gets a batch of one; a one-row batch that
does not match the dims of a model that does not batch loses its batch dimension. Anything else moves
as it is (a `[0, ...]` tensor from a non-batching step is taken as already batched, zero rows), and the
receiving model's own checks accept or refuse it.
"""

from __future__ import annotations

import numpy as np


def fit(value: np.ndarray, dims: tuple[int, ...], batching: bool, rows: int) -> np.ndarray:
    """`value` shaped for a model (or ensemble output) declaring `dims` (without the batch dimension)
    that batches or not; `rows`: the batch size of the request that made it, 0 for none."""
    if batching == (rows != 0):
        return value
    if batching:
        return value.reshape((1, *value.shape)) if matches(dims, value.shape) else value
    if rows == 1 and not matches(dims, value.shape):
        return value.reshape(value.shape[1:])
    return value


def matches(dims: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Same rank, and every dimension equal where neither side is -1 (any size)."""
    return len(dims) == len(shape) and all(d == s or d == -1 or s == -1 for d, s in zip(dims, shape))
