"""The Triton side of bench/peers.py: the same ONNX files served by Triton through PyTriton.

    <pytriton venv>/bin/python bench/peers_triton.py --models DIR --grpc-port P --http-port P --metrics-port P

Runs in its own virtual environment (nvidia-pytriton, onnxruntime, numpy; made by bench/peers.py), so
it imports nothing from Ferry. PyTriton serves Python callables: each model is one ONNX Runtime
session run inside a `@batch` callable, one instance, behind Triton's dynamic batcher with the queue
delay and max batch given here (the issue's measurement: 1 ms, 128). The session is configured as
Ferry's ONNX backend configures its own (all cores for intra-op, no spinning), so the two servers
differ in their front ends and schedulers, not in the model runtime. Prints `peers-triton: ready`
once every model answers Triton's readiness, then serves until terminated.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

# name: (input name, per-row input shape, dtype); every model answers y [16] FP32
MODELS = {
    "light": ("x", (256,), np.float32),
    "heavy": ("x", (32, 512), np.float32),
    "varlen": ("ids", (-1,), np.int64),
}


def session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 0
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def callable_for(name: str, sess: ort.InferenceSession):
    """A batched callable for one model. The variable-length model also takes `lengths`: Triton's
    dynamic batcher only batches requests of one shape, so every row of a batch is its full length."""
    input_name = MODELS[name][0]

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        feed = {input_name: inputs[input_name]}
        if name == "varlen":
            ids = feed["ids"]
            feed["lengths"] = np.full((ids.shape[0], 1), ids.shape[1], np.int64)
        return {"y": sess.run(["y"], feed)[0]}

    return infer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", required=True, help="folder holding <name>.onnx for every model")
    parser.add_argument("--names", default=",".join(MODELS), help="which of the models to serve")
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--queue-delay-us", type=int, default=1000)
    parser.add_argument("--max-batch", type=int, default=128)
    args = parser.parse_args()
    config = TritonConfig(grpc_address="127.0.0.1", grpc_port=args.grpc_port, http_address="127.0.0.1",
                          http_port=args.http_port, metrics_port=args.metrics_port, log_verbose=0)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Triton(config=config) as triton:
        for name in args.names.split(","):
            input_name, shape, dtype = MODELS[name]
            triton.bind(model_name=name, infer_func=callable_for(name, session(Path(args.models) / f"{name}.onnx")),
                        inputs=[Tensor(name=input_name, shape=shape, dtype=dtype)],
                        outputs=[Tensor(name="y", shape=(16,), dtype=np.float32)],
                        config=ModelConfig(max_batch_size=args.max_batch,
                                           batcher=DynamicBatcher(max_queue_delay_microseconds=args.queue_delay_us)),
                        strict=False)
        triton.run()
        print("peers-triton: ready", flush=True)
        while not stop.wait(0.5):
            pass
    sys.exit(0)


if __name__ == "__main__":
    main()
