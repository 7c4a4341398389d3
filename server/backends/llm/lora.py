"""LoRA adapters over one base model: every row of a step applies its own adapter beside the base matmul.

An adapter (PEFT's format: `adapter_config.json` + `adapter_model.safetensors`) adds
`scale * B @ A` to some of the layers' projections. Merging that into the weights would give each
adapter its own model copy and its own batches; here the weights stay the base's and each targeted
Linear adds `((x @ A_s^T) @ B_s^T) * scale` for the adapter `s` of each row (Punica's and S-LoRA's
batched low-rank product), so requests for any adapters and the base share one step and one KV pool.

Resident adapters live in fixed slots (`max_loras`), stacked per Linear and padded to `max_lora_rank`:
A as [slots, parts * rank, in] and B, scale folded in, as one [slots, rank, out_part] per part. q/k/v
(and gate/up) are one joined Linear here (llama.py), so an adapter's q, k and v A's sit side by side and
one matmul serves them all; each part's B then writes its own columns. A step gathers the slots its
rows use (k of them; all of them in order: no copy) and runs, per Linear, u = x @ A^T [T, k * parts *
rank], masked by a one-hot so each row keeps only its own slot's ranks, then u @ B per part. Rows of
the base model keep nothing, and a step without adapter rows skips it all. Padding ranks are zeros, so
they add exact zeros. Adapters not resident are read from their path on first use, evicting the least
recently used one the step does not need; the scheduler keeps at most `max_loras` adapters running, so a
step never needs more slots than there are.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from protos import model_config_pb2 as mc
from server.backends.base import parameter
from server.errors import AlreadyExistsError, ConfigError, InvalidInputError, ModelNotFoundError

log = logging.getLogger(__name__)

# PEFT's target module -> (the model's Linear it lands in, its part there); llama.py joins q/k/v and gate/up.
PLACES = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
          "o_proj": ("self_attn.o_proj", 0), "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
          "down_proj": ("mlp.down_proj", 0)}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_serial = itertools.count()  # makes each registration's prefix-cache seed its own, even for a reused name and path
DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 16  # as vLLM's


@dataclass(frozen=True, slots=True)
class LoraSettings:
    """The model's `parameters`: `enable_lora`, `max_loras`, `max_lora_rank` (vLLM's names), and
    `lora_modules`: `name=path` pairs separated by spaces or commas (vLLM's --lora-modules), paths
    relative to the model's folder. Any of them turns LoRA on."""

    enabled: bool = False
    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    modules: tuple[tuple[str, Path], ...] = ()

    @classmethod
    def from_config(cls, config: mc.ModelConfig, model_dir: Path) -> LoraSettings:
        source = f"model '{config.name}'"
        modules = tuple(_modules(parameter(config, "lora_modules", "") or "", model_dir, source))
        flag = (parameter(config, "enable_lora", "") or "").strip().lower()
        if flag not in ("", "true", "false"):
            raise ConfigError(f"{source}: parameter 'enable_lora' must be true or false, got {flag!r}")
        numbers = {key: _positive(config, key, default, source) for key, default in (
            ("max_loras", DEFAULT_MAX_LORAS), ("max_lora_rank", DEFAULT_MAX_LORA_RANK))}
        given = any(parameter(config, key) is not None for key in numbers)
        enabled = flag == "true" or (flag == "" and (bool(modules) or given))
        return cls(enabled, numbers["max_loras"], numbers["max_lora_rank"], modules)


def _positive(config: mc.ModelConfig, key: str, default: int, source: str) -> int:
    text = parameter(config, key)
    if text is None:
        return default
    try:
        value = int(text.strip(), 10)
    except ValueError:
        value = 0
    if not 1 <= value <= 1024:
        raise ConfigError(f"{source}: parameter '{key}' must be an integer within 1..1024, got {text!r}")
    return value


def _modules(text: str, model_dir: Path, source: str):
    for pair in text.replace(",", " ").split():
        name, eq, path = pair.partition("=")
        if not eq or not name or not path:
            raise ConfigError(f"{source}: parameter 'lora_modules' holds {pair!r}; write name=path pairs, "
                              "separated by spaces or commas")
        yield name, (model_dir / Path(path).expanduser()).resolve()


@dataclass(frozen=True, slots=True, eq=False)
class LoraAdapter:
    """One registered adapter, as read from its folder's config (its weights are read when it is made resident).
    `key` is unique per registration: it seeds the adapter's prefix-cache names, so two adapters (or one
    name registered again with other weights) never share cached blocks."""

    name: str
    path: Path
    rank: int
    scale: float
    targets: frozenset[str]
    key: bytes = field(repr=False)


def read_adapter(name: str, path: str | Path, max_rank: int) -> LoraAdapter:
    """Read and check an adapter folder; raises InvalidInputError saying what is wrong."""
    folder = Path(path).expanduser()
    try:
        config = json.loads((folder / "adapter_config.json").read_text())
    except FileNotFoundError:
        raise InvalidInputError(f"LoRA adapter '{name}': {folder} has no adapter_config.json") from None
    except (OSError, ValueError) as exc:
        raise InvalidInputError(f"LoRA adapter '{name}': {folder}/adapter_config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise InvalidInputError(f"LoRA adapter '{name}': adapter_config.json is not a PEFT LoRA config")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise InvalidInputError(f"LoRA adapter '{name}': rank r={rank!r} must be within 1..{max_rank} (max_lora_rank)")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    unsupported = sorted(set(targets) - set(PLACES))
    if not targets or unsupported:
        raise InvalidInputError(f"LoRA adapter '{name}': target_modules {sorted(targets)} must be among {', '.join(PLACES)}")
    for key, fine in (("use_dora", False), ("bias", "none"), ("modules_to_save", None)):
        if config.get(key, fine) not in (fine, [], False):
            raise InvalidInputError(f"LoRA adapter '{name}': {key}={config[key]!r} is not supported")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise InvalidInputError(f"LoRA adapter '{name}': {folder} has no adapter_model.safetensors")
    scale = alpha / rank ** 0.5 if config.get("use_rslora") else alpha / rank
    key = hashlib.blake2b(f"lora\0{name}\0{folder.resolve()}\0{next(_serial)}".encode(), digest_size=16).digest()
    return LoraAdapter(name, folder, rank, float(scale), frozenset(targets), key)


@dataclass(slots=True)
class LoraStats:
    loads: int = 0  # adapters read into a slot
    evictions: int = 0  # resident adapters dropped to make room
    mixed_steps: int = 0  # steps whose rows used more than one adapter (the base model counting as one)


class LoraStep:
    """One step's selection: which slots its rows use, and each row's one-hot over them."""

    def __init__(self, slots: torch.Tensor | None, onehot: torch.Tensor):
        self.slots = slots  # [k] resident slots used by this step; None: all of them, in order
        self.onehot = onehot  # [T, k, 1, 1] 1 where the row's adapter is that slot; a base row is all 0

    def add(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor]) -> torch.Tensor:
        # a: [slots, parts * rank, in]; bs: one [slots, rank, out_part] per part
        t, parts = x.shape[0], len(bs)
        if self.slots is not None:  # only the slots this step uses (all of them: no copy)
            a, bs = a[self.slots], [b[self.slots] for b in bs]
        k, rank = a.shape[0], bs[0].shape[1]
        u = x @ a.reshape(-1, a.shape[-1]).T  # [T, k*P*R]
        u = u.view(t, k, parts, rank) * self.onehot  # each row keeps its own slot's ranks
        if parts == 1:
            return out.addmm_(u.view(t, -1), bs[0].reshape(-1, bs[0].shape[-1]))  # [T, out]
        start = 0
        for p, b in enumerate(bs):  # each part's B adds into its own columns of the output
            size = b.shape[-1]
            out[:, start : start + size].addmm_(u[:, :, p].reshape(t, -1), b.reshape(-1, size))
            start += size
        return out  # [T, out]


class LoraSet:
    """The registered adapters of one model and the resident slots their weights occupy.

    `register`/`unregister`/`get` run on the event loop; `step` (loading into slots) on the step thread.
    They share only the adapters' records, which are immutable."""

    def __init__(self, settings: LoraSettings, model: nn.Module, device: torch.device, dtype: torch.dtype):
        self.settings = settings
        self.max_loras, self.rank = settings.max_loras, settings.max_lora_rank
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[bytes, int] = OrderedDict()  # adapter key -> slot, least recently used first
        self.stats = LoraStats()
        self.layers: dict[tuple[int, str], nn.Module] = {}  # (layer, Linear name) -> the Linear
        self.parts: dict[str, list[int]] = {}  # Linear name -> each part's output size
        args = model.args
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        sizes = {"self_attn.qkv_proj": [q, kv, kv], "self_attn.o_proj": [args.hidden_size],
                 "mlp.gate_up_proj": [args.intermediate_size] * 2, "mlp.down_proj": [args.hidden_size]}
        self.num_layers = len(model.model.layers)
        for i, layer in enumerate(model.model.layers):
            for name, parts in sizes.items():
                linear = layer.get_submodule(name)
                p = len(parts)
                linear.lora_a = torch.zeros(self.max_loras, p * self.rank, linear.in_features, device=device, dtype=dtype)
                linear.lora_b = [torch.zeros(self.max_loras, self.rank, size, device=device, dtype=dtype) for size in parts]
                self.layers[(i, name)] = linear
                self.parts[name] = parts

    @property
    def nbytes(self) -> int:
        return sum(m.lora_a.nbytes + sum(b.nbytes for b in m.lora_b) for m in self.layers.values())

    # ------------------------------------------------------------ registrations (event loop)
    def read(self, name: str, path: str | Path) -> LoraAdapter:
        return read_adapter(name, path, self.rank)

    def register(self, adapter: LoraAdapter) -> None:
        if adapter.name in self.adapters:
            raise AlreadyExistsError(f"LoRA adapter '{adapter.name}' is already loaded")
        self.adapters[adapter.name] = adapter

    def unregister(self, name: str) -> LoraAdapter:
        """Requests already running with it finish with it; new ones are refused."""
        if name not in self.adapters:
            raise ModelNotFoundError(f"LoRA adapter '{name}' is not loaded")
        return self.adapters.pop(name)

    def get(self, name: str, model: str) -> LoraAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ModelNotFoundError(f"LoRA adapter '{name}' is not loaded for model '{model}'")
        return adapter

    # ------------------------------------------------------------ residency (step thread)
    def step(self, adapters: list[LoraAdapter | None], counts: list[int], device: torch.device,
             dtype: torch.dtype) -> LoraStep | None:
        """The selection for a step whose entries use `adapters` (None: the base) over `counts` rows each;
        None when no row uses one."""
        used = list({a.key: a for a in adapters if a is not None}.values())
        if not used:
            return None
        if len(used) + (None in adapters) > 1:
            self.stats.mixed_steps += 1
        slots = sorted(self._resident(used))
        column = {a.key: slots.index(self.resident[a.key]) for a in used}  # the adapter's place among the step's slots
        per_entry = torch.tensor([-1 if a is None else column[a.key] for a in adapters], device=device)
        rows = torch.repeat_interleave(per_entry, torch.tensor(counts, device=device))  # [T]
        onehot = (rows[:, None] == torch.arange(len(slots), device=device)).to(dtype)[:, :, None, None]
        every = slots == list(range(self.max_loras))
        return LoraStep(None if every else torch.tensor(slots, device=device), onehot)

    def _resident(self, used: list[LoraAdapter]) -> list[int]:
        if len(used) > self.max_loras:
            raise InvalidInputError(f"a step needs {len(used)} LoRA adapters; max_loras is {self.max_loras}")
        needed = {a.key for a in used}
        slots = []
        for adapter in used:
            slot = self.resident.get(adapter.key)
            if slot is None:
                slot = self._free_slot(needed)
                self._load(adapter, slot)
                self.resident[adapter.key] = slot
            self.resident.move_to_end(adapter.key)
            slots.append(slot)
        return slots

    def _free_slot(self, needed: set[bytes]) -> int:
        taken = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in taken]
        if free:
            return free[0]
        victim = next(key for key in self.resident if key not in needed)  # least recently used first
        self.stats.evictions += 1
        return self.resident.pop(victim)

    def _load(self, adapter: LoraAdapter, slot: int) -> None:
        """Read the adapter's weights into `slot`, zeros wherever it has none (padding ranks, untargeted layers)."""
        for linear in self.layers.values():
            linear.lora_a[slot].zero_()
            for b in linear.lora_b:
                b[slot].zero_()
        r, R = adapter.rank, self.rank
        found = 0
        with safe_open(str(adapter.path / "adapter_model.safetensors"), framework="pt") as weights:
            for key in weights.keys():
                match = _KEY.search(key)
                if match is None or match.group(2) not in PLACES or int(match.group(1)) >= self.num_layers:
                    raise InvalidInputError(f"LoRA adapter '{adapter.name}': weight {key!r} does not fit this model")
                layer, module, which = int(match.group(1)), match.group(2), match.group(3)
                name, part = PLACES[module]
                linear, sizes = self.layers[(layer, name)], self.parts[name]
                tensor = weights.get_tensor(key)
                if which == "A":  # [r, in]
                    if tensor.shape != (r, linear.in_features):
                        raise InvalidInputError(f"LoRA adapter '{adapter.name}': {key} is {tuple(tensor.shape)}, "
                                                f"expected ({r}, {linear.in_features})")
                    linear.lora_a[slot, part * R : part * R + r] = tensor.to(linear.lora_a.dtype)
                else:  # [out_part, r], kept transposed with the scale folded in
                    b = (tensor.float() * adapter.scale).T.to(linear.lora_a.dtype)
                    if b.shape != (r, sizes[part]):
                        raise InvalidInputError(f"LoRA adapter '{adapter.name}': {key} is {tuple(tensor.shape)}, "
                                                f"expected ({sizes[part]}, {r})")
                    linear.lora_b[part][slot, :r] = b
                found += 1
        self.stats.loads += 1
        log.info("LoRA adapter '%s' (rank %d, %d tensors) loaded into slot %d", adapter.name, r, found, slot)
