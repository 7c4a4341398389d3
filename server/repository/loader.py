"""Turn one model folder into loaded versions: config, signature, backend instances.

Runs in a worker thread at startup (model files can be large); nothing here touches the event loop.
Failures are per version where possible, so one corrupt file never hides the model's other versions.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path

from protos import model_config_pb2 as mc
from server import backends, heap
from server.backends import python_based
from server.tensors import classification
from server.backends.base import Backend, Device
from server.errors import ConfigError, FerryError
from server.names import is_version_folder
from server.repository import config as config_io
from server.repository import ensemble_config, footprint, warmup
from server.tensors.signature import Signature

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedVersion:
    version: int
    config: mc.ModelConfig | None = None
    signature: Signature | None = None
    backends: list[Backend] = field(default_factory=list)
    error: str = ""
    footprint: footprint.Footprint | None = None  # what its instances hold (None: not loaded, only described)


def scan(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))


def version_dirs(model_dir: Path) -> dict[int, Path]:
    return {int(p.name): p for p in model_dir.iterdir() if p.is_dir() and is_version_folder(p.name)}


def without_paths(message: str, model_dir: Path) -> str:
    """`message` with the server's absolute paths replaced by repository-relative ones.

    Backends (ONNX Runtime, torch, a model.py's own exceptions) quote the files they were given; a
    client must not learn where the repository lives, so the model folder (as given and resolved,
    which differ when it is a symlink) becomes its name and the repository root disappears."""
    for prefix, replacement in sorted({(str(model_dir.resolve()), model_dir.name), (str(model_dir), model_dir.name),
                                       (str(model_dir.parent.resolve()) + "/", ""), (str(model_dir.parent) + "/", "")},
                                      key=lambda pair: -len(pair[0])):
        message = message.replace(prefix, replacement)
    return message


def select_versions(policy: mc.ModelVersionPolicy, available: list[int]) -> list[int]:
    """Versions to serve under Triton's version_policy (default: the latest one)."""
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return sorted(available)
    if which == "specific":
        return sorted(set(policy.specific.versions))
    count = policy.latest.num_versions if which == "latest" else 1
    return sorted(available)[-max(count, 1):]


def load_model(model_dir: Path, default_max_batch_size: int, config: mc.ModelConfig | None = None,
               describe_only: bool = False, backend_directory: Path | None = None,
               calls=None) -> tuple[mc.ModelConfig, list[LoadedVersion]]:
    """Read the config (or take `config`, a load request's override) and load every selected version;
    raises ConfigError for model-wide problems. `describe_only`: complete and check each version's config
    and signature but build no instance (on-demand model control answers metadata before any load).
    `backend_directory`: where Python-based backends live (`ferry serve --backend-directory`). `calls`: the
    server's side of BLS, model control and metrics, bound to Python instances before they initialize."""
    if config is not None:
        base, source = copy.deepcopy(config), f"{model_dir.name} (the load request's 'config' parameter)"
    else:
        base = config_io.read_config(model_dir)
        found = config_io.config_path(model_dir)
        source = config_io.shown(found, model_dir) if found else f"{model_dir.name}/"
    on_disk = version_dirs(model_dir)
    if not on_disk:
        raise ConfigError(f"{model_dir.name}/: no numbered version folder (e.g. {model_dir.name}/1/)")
    if ensemble_config.is_ensemble(base):
        return base, [_ensemble_version(base, number, on_disk, source) for number in
                      select_versions(base.version_policy, list(on_disk))]
    runtime = None if backends.is_builtin(base.backend) else python_based.runtime_path(base, backend_directory, source)
    if runtime is not None:  # the backend's model.py serves this model as if it were in each version folder
        base.runtime, name = python_based.RUNTIME, "python"
    else:
        name = backends.resolve_backend_name(base, list(on_disk.values()), source)
    if not base.backend:
        base.backend = name
    backend_cls = backends.backend_class(name)
    versions = select_versions(base.version_policy, list(on_disk))
    loaded = []
    for number in versions:
        entry = LoadedVersion(number)
        try:
            if number not in on_disk:
                raise ConfigError(f"{source}: version_policy names version {number} but {model_dir.name}/{number}/ does not exist")
            _load_version(entry, base, backend_cls, on_disk[number], source, default_max_batch_size, describe_only, runtime,
                          calls)
        except Exception as exc:  # noqa: BLE001 - a model that cannot load must not stop the others
            error = exc.message if isinstance(exc, FerryError) else f"{model_dir.name}/{number}: {type(exc).__name__}: {exc}"
            entry.error = without_paths(error, model_dir)
            log.error("model '%s' version %d failed to load: %s", model_dir.name, number, entry.error)
            for backend in entry.backends:
                backend.unload()
            entry.backends = []
        loaded.append(entry)
    return base, loaded


def _load_version(entry: LoadedVersion, base, backend_cls, version_dir: Path, source: str, default_mbs: int,
                  describe_only: bool = False, runtime: Path | None = None, calls=None) -> None:
    config = copy.deepcopy(base)
    model_path = runtime or _model_file(config, backend_cls, version_dir)
    backend_cls.complete_config(config, model_path, default_mbs)
    if config.max_batch_size > 0 and config.WhichOneof("scheduling_choice") is None and not base.input:
        config.dynamic_batching.SetInParent()  # auto-completed batching models batch dynamically (as Triton)
    config_io.validate(config, source)
    _check_bf16(config, backend_cls, source)
    signature = Signature.from_config(config, text_bytes=backend_cls.bytes_as_text)
    labels = classification.read_labels(config, version_dir.parent, source)
    entry.config, entry.signature = config, dataclasses.replace(signature, labels=labels)
    declared = footprint.declared(config, source)
    if describe_only:
        return
    placed = _placed(config, backend_cls)
    gpus = {device.index for device, _, _ in placed if device.kind == "cuda"}
    backend_cls.prime()
    heap.trim()  # free pages the heap kept (the config's completion read the model file) would hide the load's own
    before = footprint.snapshot(gpus)
    for index, (device, group, name) in enumerate(placed):
        backend = backend_cls(config, model_path, device)
        backend.instance, backend.instance_name, backend.version_dir = index, name, version_dir
        backend.instance_group = group  # its rate_limiter (scheduling/rate_limiter.py)
        if calls is not None and hasattr(backend, "calls"):
            backend.calls = calls
        entry.backends.append(backend)
        backend.load()
    if config.model_warmup:
        _check_warmable(config, backend_cls, source)
        warmup.run(config, entry.signature, entry.backends, version_dir.parent, source)
    if not declared:
        heap.trim()  # what the load took only for a while (the model file read whole, the runtime's copies) is not held
        entry.footprint = footprint.measured(before, footprint.snapshot(gpus))
    else:
        entry.footprint = declared
    for key, value in entry.backends[0].describe().items():
        config.parameters[key].string_value = value


def _check_bf16(config: mc.ModelConfig, backend_cls, source: str) -> None:
    """BF16 is served where the backend hands it on as such (the Python backend, through DLPack)."""
    if backend_cls.takes_bf16:
        return
    for kind, tensors in (("input", config.input), ("output", config.output)):
        for tensor in tensors:
            if tensor.data_type == mc.TYPE_BF16:
                raise ConfigError(f"{source}: {kind} {tensor.name!r} is TYPE_BF16, which the {backend_cls.name} backend "
                                  "does not take in Ferry; BF16 is served by the python backend")


def _check_warmable(config: mc.ModelConfig, backend_cls, source: str) -> None:
    """Warmup samples are plain batches; kinds whose executions need more are refused, not skipped."""
    kind = (f"the {backend_cls.name} backend (it runs no batches of inputs)" if not backend_cls.runs_batches
            else "a decoupled model" if config.model_transaction_policy.decoupled
            else "a sequence model (its samples would need the sequence's control inputs)"
            if config.HasField("sequence_batching") else None)
    if kind is not None:
        raise ConfigError(f"{source}: model_warmup is not supported by Ferry for {kind} yet; remove it")


def _ensemble_version(base: mc.ModelConfig, number: int, on_disk: dict[int, Path], source: str) -> LoadedVersion:
    """An ensemble runs no backend of its own: a version is its checked config and signature."""
    if number not in on_disk:
        return LoadedVersion(number, error=f"{source}: version_policy names version {number} but it does not exist")
    config = copy.deepcopy(base)
    config.platform = ensemble_config.ENSEMBLE
    config_io.validate(config, source)
    ensemble_config.step_order(config, source)
    return LoadedVersion(number, config, Signature.from_config(config))


def _model_file(config: mc.ModelConfig, backend_cls, version_dir: Path) -> Path:
    candidates = [config.default_model_filename] if config.default_model_filename else [backend_cls.default_filename]
    if backend_cls.name == "pytorch" and not config.default_model_filename:
        candidates.append("model.pt2")
    for name in candidates:
        if (version_dir / name).exists():
            return version_dir / name
    raise ConfigError(f"{version_dir.parent.name}/{version_dir.name}/: model file {' or '.join(candidates)} is missing")


def _placed(config: mc.ModelConfig, backend_cls) -> list[tuple[Device, int, str]]:
    """Each instance's device, the index of its instance group (whose rate_limiter it follows) and Triton's
    name for it: `<group>_<index in group>`, the group named by its `name` or `<model>_<group index>` (so a
    one-instance model's is `<model>_0_0`, as model code sees in `args["model_instance_name"]`)."""
    placed = []
    for g, group in enumerate(config.instance_group):
        prefix = group.name or f"{config.name}_{g}"
        placed += [(device, g, f"{prefix}_{i}") for i, device in enumerate(_group_devices(config, group, backend_cls))]
    return placed


def _group_devices(config: mc.ModelConfig, group, backend_cls) -> list[Device]:
    kind = mc.ModelInstanceGroup.Kind
    if group.kind == kind.Value("KIND_CPU"):
        return [Device("cpu")] * group.count
    cuda_count = backend_cls.cuda_devices()
    if group.kind == kind.Value("KIND_GPU") and cuda_count == 0:
        raise ConfigError(f"instance_group asks for KIND_GPU but no CUDA device works for the {backend_cls.name} backend")
    if cuda_count == 0:
        return [Device("cpu")] * group.count  # KIND_AUTO or KIND_MODEL without CUDA
    if group.kind == kind.Value("KIND_MODEL"):  # the model places itself (Triton's vLLM folders): not one per GPU
        return [Device("cuda", 0)] * group.count
    gpus = list(group.gpus) or list(range(cuda_count))
    for gpu in gpus:
        if gpu >= cuda_count:
            raise ConfigError(f"instance_group names gpu {gpu} but only {cuda_count} CUDA devices exist")
    return [Device("cuda", gpu) for gpu in gpus for _ in range(group.count)]
