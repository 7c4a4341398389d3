"""The long-lived heap and Python's cycle collector.

Startup leaves millions of long-lived objects (torch, onnx, protobuf descriptors, the models). A full
collection walks every one of them: a stall of tens of ms for every request in flight, which set the
light benchmark model's p99. Once loading is done they are parked outside the collector. Parked
objects are still freed by reference counting; only a reference cycle among them would outlive its
use, so an unload hands everything back to the collector once and parks what survives.
"""

from __future__ import annotations

import gc


def park() -> None:
    gc.collect()
    gc.freeze()


def reclaim() -> None:
    """After models were unloaded: collect what they left in cycles, park the rest again."""
    if gc.get_freeze_count():
        gc.unfreeze()
        park()
