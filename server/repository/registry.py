"""Live (model, version) -> state and runner; the one place requests look models up.

The registry knows names, versions, folders and load/unload/ready states. It builds no serving
objects itself: the runner factory app.py hands it turns each loaded version into a `Runner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from protos import model_config_pb2 as mc
from server import heap
from server.defaults import DEFAULT_MAX_BATCH_SIZE, DRAIN_GRACE_S
from server.errors import ConfigError, ModelNotFoundError, ModelUnavailableError
from server.names import check_model_name, parse_version, shown
from server.repository import footprint as footprints
from server.repository import inline_load, loader
from server.tensors.signature import Signature

if TYPE_CHECKING:
    from server.observability.metrics import ModelStats
    from server.repository.on_demand import OnDemand
    from server.runners.base import Runner

    BuildRunner = Callable[[str, loader.LoadedVersion], Runner]

log = logging.getLogger(__name__)

LOADING, READY, UNAVAILABLE, UNLOADING = "LOADING", "READY", "UNAVAILABLE", "UNLOADING"
NOT_LOADED = "not loaded: loads on its first inference request (--model-control-mode on_demand)"


@dataclass(slots=True)
class ModelVersion:
    name: str
    version: int
    state: str = LOADING
    reason: str = ""
    config: mc.ModelConfig | None = None
    signature: Signature | None = None
    runner: Runner | None = None
    cold: bool = False  # on-demand model control: described, not loaded; its first request loads it
    footprint: footprints.Footprint | None = None  # what its instances hold while it is loaded
    backends: tuple = ()  # its instances' backends, asked what they hold when it is unloaded (heap.reclaim)

    @property
    def ready(self) -> bool:
        return self.state == READY


@dataclass(frozen=True, slots=True, order=True)
class IndexRow:
    """One line of the repository index: a model version found, loaded or not (version '' : the model)."""

    name: str
    version: str
    state: str
    reason: str


class Registry:
    def __init__(self, root: Path, build_runner: BuildRunner, default_max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 drain_grace_s: float = DRAIN_GRACE_S, backend_directory: Path | None = None):
        self.root = root
        self.backend_directory = backend_directory  # Python-based backends (`--backend-directory`), None: off
        self.build_runner = build_runner
        self.default_max_batch_size = default_max_batch_size
        self.drain_grace_s = drain_grace_s  # for versions retired by a reload or unload
        self._models: dict[str, dict[int, ModelVersion]] = {}
        self._errors: dict[str, str] = {}  # model-wide failures (bad config), shown with an empty version
        self._locks: dict[str, asyncio.Lock] = {}  # one load or unload of a model at a time
        self._tasks: set[asyncio.Task] = set()  # loads and unloads in progress
        self._loading: set[str] = set()  # names being loaded with nothing registered yet: UNAVAILABLE, not NOT_FOUND
        self._folders: dict[str, Path] = {}  # the folder each model's serving versions came from
        self._staged: set[Path] = set()  # temporary folders of inline files (RepositoryModelLoad 'file:')
        self.on_demand: OnDemand | None = None  # on-demand model control (server/repository/on_demand.py), set by the engine

    async def load_all(self, names: frozenset[str] | None = None) -> None:
        """Load every model folder, or only those named (explicit model control's start-up models)."""
        dirs = [d for d in loader.scan(self.root) if names is None or d.name in names]
        for missing in sorted((names or set()) - {d.name for d in dirs}):
            log.error("model '%s' was asked to load at start-up but has no folder in the repository", missing)
        self._loading.update(d.name for d in dirs)  # known from the scan on, so start-up answers "loading"
        await asyncio.gather(*(self._load(d) for d in dirs))

    async def load(self, name: str, override: inline_load.LoadOverride | None = None) -> None:
        """(Re)load one model from its folder, or from `override` (a config, inline files). New versions
        replace the old ones only if at least one of them is ready; otherwise the old ones keep serving
        and the reason is raised."""
        check_model_name(name)  # before any path is built from it
        staged = None
        if override is not None and override.files:
            staged = await asyncio.to_thread(inline_load.stage, name, override.files)
            self._staged.add(staged)
            model_dir = staged
        else:
            model_dir = self.root / name
            if not model_dir.is_dir():
                raise ModelNotFoundError(f"failed to load {shown(name)}, failed to poll from model repository: "
                                         f"no model folder {shown(name)} in the model repository")
        config = override.config if override is not None else None
        try:
            error = await self._owned(self._locked(name, self._load(model_dir, config)))
        finally:
            if staged is not None and self._folders.get(name) != staged:
                self._forget_folder(staged)
        if error:
            raise ModelUnavailableError(f"failed to load model '{name}': {error}")

    async def describe_all(self) -> None:
        """On-demand model control: every model folder described (config, signature), none loaded."""
        for model_dir in loader.scan(self.root):
            name = model_dir.name
            try:
                _, described = await asyncio.to_thread(loader.load_model, model_dir, self.default_max_batch_size, None, True,
                                                         self.backend_directory)
            except Exception as exc:  # noqa: BLE001 - one bad folder must not stop the others
                self._errors[name] = loader.without_paths(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}", model_dir)
                log.error("model '%s' is unavailable: %s", name, self._errors[name])
                continue
            self._models[name] = {e.version: ModelVersion(name, e.version, UNAVAILABLE, e.error or NOT_LOADED, e.config, e.signature,
                                                          cold=not e.error) for e in described}
            self._folders[name] = model_dir

    def is_cold(self, name: str) -> bool:
        return any(mv.cold for mv in self._models.get(name, {}).values())

    async def load_cold(self, name: str) -> str:
        """Load a cold model from its folder; returns '' or why it failed (its versions stay cold: the next
        request tries again)."""
        for mv in self._models.get(name, {}).values():
            if mv.cold:
                mv.state, mv.reason = LOADING, "loading on demand"
        error = await self._owned(self._locked(name, self._load(self.root / name)))
        for mv in self._models.get(name, {}).values():
            if not mv.ready:
                mv.cold, mv.state = True, UNAVAILABLE
        return error

    async def evict(self, name: str, why: str) -> None:
        """Unload an idle model, leaving it cold (its next request loads it again)."""
        versions = list(self._models.get(name, {}).values())
        for mv in versions:
            mv.cold = True  # from now on a request for it waits for its next load, not for this unload
        # Evictions come several a second under a tight budget: heap.reclaim walks the parked heap only where
        # a cycle keeps what the model held, which the budget would otherwise count as freed while it stays.
        await self._owned(self._locked(name, self._retire(versions, self.drain_grace_s)))
        for mv in versions:
            mv.state, mv.reason, mv.runner, mv.footprint = UNAVAILABLE, why, None, None
        await asyncio.to_thread(heap.trim)  # it walks every arena: not on the loop, where requests are served

    def footprint(self, name: str) -> footprints.Footprint:
        """What a model's ready versions hold together."""
        total: dict[str, int] = {}
        declared = True
        for mv in self._models.get(name, {}).values():
            if mv.ready and mv.footprint is not None:
                declared &= mv.footprint.declared
                for place, nbytes in mv.footprint.bytes_by_place.items():
                    total[place] = total.get(place, 0) + nbytes
        return footprints.Footprint(total, declared and bool(total))

    def _forget_folder(self, folder: Path | None) -> None:
        if folder in self._staged:
            self._staged.discard(folder)
            inline_load.remove(folder)

    async def unload(self, name: str) -> None:
        """Stop serving a model: refuse new requests, let admitted ones finish, release its memory."""
        check_model_name(name)
        if not self.knows(name):
            raise ModelNotFoundError(f"Request for unknown model: {shown(name)} is not found")
        await self._owned(self._locked(name, self._unload(name, self.drain_grace_s)))

    async def _unload(self, name: str, grace_s: float) -> str:
        versions = list(self._models.get(name, {}).values())
        await self._retire(versions, grace_s)
        for mv in versions:
            mv.state, mv.reason, mv.runner = UNAVAILABLE, "unloaded", None
        self._forget_folder(self._folders.pop(name, None))
        return ""

    async def _locked(self, name: str, work):
        async with self._locks.setdefault(name, asyncio.Lock()):
            return await work

    async def _owned(self, work):
        """Run `work` as a task of the registry's own; a cancelled caller stops waiting, the work goes on."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _load(self, model_dir: Path, config: mc.ModelConfig | None = None) -> str:
        """Load a model folder; returns '' or why nothing of it is ready."""
        self._loading.add(model_dir.name)
        try:
            return await self._load_folder(model_dir, config)
        finally:
            self._loading.discard(model_dir.name)

    async def _load_folder(self, model_dir: Path, config: mc.ModelConfig | None) -> str:
        name = model_dir.name
        try:
            # Python models reach the server from initialize and warmup too (pb_utils.load_model, metrics)
            calls = self.build_runner.model_calls() if hasattr(self.build_runner, "model_calls") else None
            _, loaded = await asyncio.to_thread(loader.load_model, model_dir, self.default_max_batch_size, config,
                                                 False, self.backend_directory, calls=calls)
        except Exception as exc:  # noqa: BLE001 - one bad folder must not stop the others
            reason = loader.without_paths(getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}", model_dir)
            log.error("model '%s' is unavailable: %s", name, reason)
            if not self.ready_versions(name):
                self._errors[name] = reason
            return reason
        versions = {entry.version: self._start(name, entry) for entry in loaded}
        ready = any(mv.ready for mv in versions.values())
        why = "" if ready else "; ".join(f"version {v}: {mv.reason}" for v, mv in versions.items()) or "no version to serve"
        if not ready and self.ready_versions(name):
            return why  # the versions already serving stay
        old = list(self._models.get(name, {}).values())
        self._models[name] = versions
        self._errors.pop(name, None)
        old_folder, self._folders[name] = self._folders.get(name), model_dir
        await self._retire(old, self.drain_grace_s)
        if old_folder != model_dir:
            self._forget_folder(old_folder)
        return why

    def _start(self, name: str, entry: loader.LoadedVersion) -> ModelVersion:
        mv = ModelVersion(name, entry.version, config=entry.config, signature=entry.signature, footprint=entry.footprint)
        if entry.error:
            mv.state, mv.reason = UNAVAILABLE, entry.error
            return mv
        try:
            mv.runner = self.build_runner(name, entry)
        except ConfigError as exc:
            mv.state, mv.reason = UNAVAILABLE, exc.message
            for backend in entry.backends:
                backend.unload()
            return mv
        mv.runner.start()
        mv.backends = tuple(entry.backends)
        mv.state = READY
        log.info("model '%s' version %d is READY (%d instance(s), memory %s)", name, entry.version, len(entry.backends),
                 entry.footprint.shown() if entry.footprint else "unknown")
        return mv

    @staticmethod
    async def _retire(versions: list[ModelVersion], grace_s: float) -> None:
        closing, watched = [], []
        for mv in versions:
            if mv.runner is not None:
                mv.state = UNLOADING
                closing.append(mv.runner.close(grace_s))
                for backend in mv.backends:  # weak references only: nothing here may keep what they watch
                    refs = heap.watch(backend.held())
                    watched = None if refs is None or watched is None else watched + refs
        await asyncio.gather(*closing)
        for mv in versions:
            mv.backends = ()
        if closing:
            heap.reclaim(watched)

    def get(self, name: str, version: str = "", cold_ok: bool = False) -> ModelVersion:
        """The version a request should use; raises NOT_FOUND / UNAVAILABLE / INVALID_ARGUMENT errors.
        `cold_ok`: a cold version (on-demand model control, not loaded) is returned too: it has a config
        and a signature for metadata, no runner."""
        versions = self._models.get(name)
        if versions is None:
            if name in self._loading:
                raise ModelUnavailableError(f"model '{name}' is loading")
            if name in self._errors:
                raise ModelUnavailableError(f"model '{name}' is not available: {self._errors[name]}")
            raise ModelNotFoundError(f"Request for unknown model: {shown(name)} is not found")
        if version:
            mv = versions.get(parse_version(version))
            if mv is None:
                raise ModelNotFoundError(f"Request for unknown model: '{name}' version {version} is not found")
            if not (mv.ready or cold_ok and mv.cold):
                raise ModelUnavailableError(f"model '{name}' version {version} is not at ready state: {mv.state} {mv.reason}".rstrip())
            return mv
        if len(versions) == 1:  # the usual case: one version, nothing to choose
            (mv,) = versions.values()
            if mv.ready or cold_ok and mv.cold:
                return mv
        ready = [v for v in versions.values() if v.ready or cold_ok and v.cold]
        if not ready:
            reasons = "; ".join(f"version {v.version}: {v.reason or v.state}" for v in versions.values())
            raise ModelUnavailableError(f"model '{name}' has no available versions ({reasons})")
        return max(ready, key=lambda v: v.version)

    def lease(self, name: str, remaining_s: float | None):
        """What an inference request holds while it is served: with on-demand model control, its model
        loaded and kept resident (server/repository/on_demand.py); otherwise nothing."""
        return contextlib.nullcontext() if self.on_demand is None else self.on_demand.lease(name, remaining_s)

    def on_disk(self, name: str) -> bool:
        """A model folder of this name is in the repository (loaded or not)."""
        check_model_name(name)
        return (self.root / name).is_dir()

    def knows(self, name: str) -> bool:
        return name in self._models or name in self._errors or name in self._loading

    def ready_versions(self, name: str) -> list[int]:
        return sorted(v.version for v in self._models.get(name, {}).values() if v.ready)

    def listed_versions(self, name: str) -> list[int]:
        """Versions that serve now or load on their first request (on-demand model control)."""
        return sorted(v.version for v in self._models.get(name, {}).values() if v.ready or v.cold)

    def all_versions(self, name: str = "") -> list[ModelVersion]:
        names = [name] if name else sorted(self._models)
        return [mv for n in names for _, mv in sorted(self._models.get(n, {}).items())]

    def stats(self) -> list[ModelStats]:
        return [mv.runner.stats for mv in self.all_versions() if mv.runner is not None]

    def index(self) -> list[IndexRow]:
        """Every model found, loaded or not, sorted by name and version."""
        rows = [IndexRow(n, "", UNAVAILABLE, reason) for n, reason in self._errors.items()]
        rows += [IndexRow(n, "", LOADING, "") for n in self._loading if n not in self._models and n not in self._errors]
        shown = self.on_demand is not None  # elsewhere a ready row's reason stays empty, as Triton's (clients compare it)
        rows += [IndexRow(mv.name, str(mv.version), mv.state, mv.reason or (_memory(mv) if shown else ""))
                 for mv in self.all_versions()]
        return sorted(rows)

    async def close(self, grace_s: float) -> None:
        await self._retire(self.all_versions(), grace_s)
        # Stopping stalls no request: collect everything, so what only a cycle still holds is let go before
        # the process ends (requests' tensors among it, which hold front ends' arena blocks until freed:
        # tests/integration/test_frontend_processes.py checks every block is back at stop).
        heap.reclaim()
        for folder in list(self._staged):
            self._forget_folder(folder)


def _memory(mv: ModelVersion) -> str:
    """A ready version's index reason under on-demand model control: the memory it holds against the budget
    (Triton leaves it empty; in the other modes Ferry does too, and the footprint is in statistics and /metrics)."""
    return f"memory: {mv.footprint.shown()}" if mv.ready and mv.footprint is not None else ""
