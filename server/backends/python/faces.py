"""The two faces of a model.py, behind one small interface the model process drives.

Triton's face: `class TritonPythonModel` with `execute(requests) -> [InferenceResponse]` (or `async
def execute`; a decoupled model answers through each request's response sender and returns None).
Ferry's short face: `class Model` with `execute(dict of arrays) -> dict of arrays`, run on the batch's
requests joined along dim 0 (one call per batch), or, decoupled, a generator yielding one dict per
response. Both take `initialize(args)` and `finalize()`; the process handles everything else alike.
"""

from __future__ import annotations

import ast
import asyncio
import importlib.util
import inspect
import sys
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from server.backends.python import pb_utils as pb
from server.backends.python import protocol as p


def import_model(path: Path):
    """model.py as the module `model` would be imported by Triton's stub (its folder first on sys.path), as
    a package of its folder: `from . import helper` finds the folder's helper.py, as in Triton."""
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path, submodule_search_locations=[str(path.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def defines_auto_complete(path: Path) -> bool:
    """Whether model.py's TritonPythonModel defines auto_complete_config, read without running it."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.ClassDef) and node.name == "TritonPythonModel"
               and any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "auto_complete_config"
                       for f in node.body) for node in tree.body)


class Face:
    kind = ""

    def __init__(self, model, loop: asyncio.AbstractEventLoop):
        self.model, self.loop = model, loop
        self._async_loop: asyncio.AbstractEventLoop | None = None  # decoupled async executes (_executing)

    def _wait(self, result):
        return self.loop.run_until_complete(result) if inspect.isawaitable(result) else result

    def initialize(self, args: dict) -> None:
        if hasattr(self.model, "initialize"):
            self._wait(self.model.initialize(self._args(args)))

    def finalize(self) -> None:
        if hasattr(self.model, "finalize"):
            self._wait(self.model.finalize())

    @property
    def checks_ready(self) -> bool:
        return hasattr(self.model, "is_ready")

    def is_ready(self) -> bool:
        """On whichever thread reads the link (model code may be running on the main thread)."""
        ready = self.model.is_ready()
        if inspect.isawaitable(ready):
            ready = asyncio.new_event_loop().run_until_complete(ready)
        return ready

    def _args(self, args: dict) -> dict:
        raise NotImplementedError

    def run(self, requests: list[pb.InferenceRequest]) -> list[pb.InferenceResponse]:
        raise NotImplementedError

    def run_decoupled(self, requests: list[pb.InferenceRequest], senders: list[pb.InferenceResponseSender],
                      concurrent: bool = False) -> Future | None:
        """Run a decoupled execute. With `concurrent`, an `async def execute` is started on the instance's
        own event loop and its future returned at once (None: execute is over)."""
        raise NotImplementedError


class TritonFace(Face):
    kind = p.TRITON

    def _args(self, args: dict) -> dict:
        return {key: value for key, value in args.items() if not key.startswith("ferry_")}

    def run(self, requests):
        returned = self.model.execute(requests)
        if inspect.isawaitable(returned):
            # on the instance's async loop, which keeps running after execute returns: tasks the model
            # started (a response sent later through a request's response sender) go on, as in Triton
            returned = asyncio.run_coroutine_threadsafe(_awaited(returned), self._executing()).result()
        responses = [None] * len(requests) if returned is None else returned  # answered by response senders
        if not isinstance(responses, (list, tuple)) or len(responses) != len(requests):
            got = f"{len(responses)} responses" if isinstance(responses, (list, tuple)) else type(responses).__name__
            raise pb.TritonModelException(f"execute must return one InferenceResponse per request: "
                                          f"{len(requests)} requests, got {got}")
        return list(responses)

    def run_decoupled(self, requests, senders, concurrent=False):
        returned = self.model.execute(requests)
        if concurrent and inspect.isawaitable(returned):
            return asyncio.run_coroutine_threadsafe(_returns_none(returned), self._executing())
        if self._wait(returned) is not None:
            raise ReturnedResponses(_RETURNS_NONE)
        return None

    def _executing(self) -> asyncio.AbstractEventLoop:
        """Triton's async execute for decoupled models: every request's coroutine runs on one event loop
        of the instance's, so the next request starts while one awaits."""
        if self._async_loop is None:
            self._async_loop = asyncio.new_event_loop()
            threading.Thread(target=self._async_loop.run_forever, name="ferry-async-execute", daemon=True).start()
        return self._async_loop


class FerryFace(Face):
    kind = p.FERRY

    def _args(self, args: dict) -> dict:
        return {"config": args["ferry_config"], "version_dir": args["ferry_version_dir"],
                "device": args["ferry_device"], "instance": args["ferry_instance"]}

    def run(self, requests):
        return [self._response(self.model.execute(_arrays(r))) for r in requests]

    def run_decoupled(self, requests, senders, concurrent=False):
        for request, sender in zip(requests, senders):
            produced = self.model.execute(_arrays(request))
            if isinstance(produced, dict):
                raise pb.TritonModelException("this model is decoupled: its execute must yield one dict per "
                                              "response (a generator), not return a dict")
            for outputs in produced:
                if sender.is_cancelled():
                    break
                sender.send(self._response(outputs))
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    @staticmethod
    def _response(outputs) -> pb.InferenceResponse:
        if not isinstance(outputs, dict):
            raise pb.TritonModelException(f"execute must return a dict of output name -> array, "
                                          f"got {type(outputs).__name__}")
        return pb.InferenceResponse([pb.Tensor(name, np.asarray(value)) for name, value in outputs.items()])


class ReturnedResponses(pb.TritonModelException):
    """A decoupled model's execute returned responses: the model process words it as Triton does, with the
    instance's name."""


_RETURNS_NONE = "a decoupled model's execute must return None"


async def _awaited(execute):
    return await execute


async def _returns_none(execute) -> None:
    if await execute is not None:
        raise ReturnedResponses(_RETURNS_NONE)


def _arrays(request: pb.InferenceRequest) -> dict[str, np.ndarray]:
    return {t.name(): t.array for t in request.inputs()}  # BF16 as ml_dtypes.bfloat16


def face_of(module, path: Path, loop: asyncio.AbstractEventLoop) -> Face:
    if hasattr(module, "TritonPythonModel"):
        return TritonFace(module.TritonPythonModel(), loop)
    if hasattr(module, "Model"):
        return FerryFace(module.Model(), loop)
    raise pb.TritonModelException(f"{path} defines neither `class TritonPythonModel` (Triton's API) "
                                  "nor `class Model` (Ferry's short form)")
