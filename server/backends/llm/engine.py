"""The generation backend: a Llama-family model, its KV cache and one `step` per scheduler plan.

The scheduler decides (which sequences, how many tokens each); this module only turns a plan into
tensors, runs one forward pass over every scheduled token at once and samples. It never decides.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from protos import model_config_pb2 as mc
from server.backends.base import Backend, Device
from server.backends.llm import cpu_decode, guided, linear, lora, paged_kernel, shared_prefix, torch_thread
from server.backends.llm.attention import StepMetadata, build_group, split_by_length
from server.backends.llm.hf_config import LlamaArgs
from server.backends.llm.llama import LlamaForCausalLM, rope_inv_freq
from server.backends.llm.sampler import History, TokenLogprobs, choose
from server.backends.llm.tokenizer import TextTokenizer
from server.errors import ConfigError, FerryError, InvalidInputError
from server.scheduling.continuous import StepPlan
from server.scheduling.sequence import Constraint

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """The engine's own part of the `generation` section: KV cache layout and sizing, dtype, length.
    (The scheduler's part is read by runners/settings.py.)"""

    block_size: int = 16
    num_kv_blocks: int = 0
    kv_cache_memory_mb: int = 0  # 0: 256 MB on the CPU; on CUDA what gpu_memory_utilization leaves
    max_model_len: int = 0
    dtype: str = "auto"
    gpu_memory_utilization: float = 0.9

    @classmethod
    def from_config(cls, g: mc.ModelGeneration, source: str) -> EngineSettings:
        defaults = cls()
        values = {f: getattr(g, f) or getattr(defaults, f) for f in (
            "block_size", "num_kv_blocks", "kv_cache_memory_mb", "max_model_len", "dtype", "gpu_memory_utilization")}
        if values["dtype"] not in ("auto", *_DTYPES):
            raise ConfigError(f"{source}: field 'generation.dtype' is {values['dtype']!r}; use auto, {', '.join(_DTYPES)}")
        if not 0 < values["gpu_memory_utilization"] <= 1:
            raise ConfigError(f"{source}: field 'generation.gpu_memory_utilization' must be within (0, 1], "
                              f"got {values['gpu_memory_utilization']}")
        if values["block_size"] > 1024:
            raise ConfigError(f"{source}: field 'generation.block_size' {values['block_size']} is too large (<= 1024)")
        return cls(**values)


class LLMBackend(Backend):
    name = "llm"
    default_filename = "config.json"
    runs_batches = False  # steps of sequences, never a batch of inputs

    @classmethod
    def cuda_devices(cls) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @classmethod
    def complete_config(cls, config: mc.ModelConfig, model_path: Path, default_max_batch_size: int) -> None:
        """Describe the model the way Triton's vLLM backend does, so KServe metadata stays meaningful."""
        config.platform = config.platform or "ferry_llm"
        config.max_batch_size = 0
        config.model_transaction_policy.decoupled = True  # many responses per request (ModelStreamInfer)
        if not config.input:
            config.input.add(name="text_input", data_type=mc.TYPE_STRING, dims=[1])
            for name, dtype in (("stream", mc.TYPE_BOOL), ("sampling_parameters", mc.TYPE_STRING),
                                ("exclude_input_in_output", mc.TYPE_BOOL), ("max_tokens", mc.TYPE_INT32)):
                config.input.add(name=name, data_type=dtype, dims=[1], optional=True)
        if not config.output:
            config.output.add(name="text_output", data_type=mc.TYPE_STRING, dims=[-1])

    def __init__(self, config: mc.ModelConfig, model_path: Path, device: Device):
        super().__init__(config, model_path, device)
        self.folder = model_path.parent
        self.settings = EngineSettings.from_config(config.generation, str(self.folder))
        self.lora_settings = lora.LoraSettings.from_config(config, model_path.parent.parent)
        self.loras: lora.LoraSet | None = None  # with LoRA on: the adapters and their resident slots
        self.logprobs: dict[int, list[TokenLogprobs]] = {}  # filled by `step`, emptied by `take_logprobs`
        self.shared_prefix_reads = 0  # key reads a layer saved by shared-prefix attention, since load

    def load(self) -> None:
        """On the CPU, on the thread that will run the steps (torch_thread.py)."""
        torch_thread.run(self.device, self._load)

    def _load(self) -> None:
        self.args = LlamaArgs.load(self.folder)
        self.torch_device = torch.device(str(self.device))
        self.dtype = self._dtype()
        model = LlamaForCausalLM(self.args)
        model.load_weights(self.folder)
        self.model = model.to(device=self.torch_device, dtype=self.dtype).eval()
        self.onednn_linear = linear.probe(self.torch_device, self.dtype)
        if self.onednn_linear:
            linear.use_onednn(self.model)
        # .to(dtype) converts buffers too; rotary frequencies rounded to bf16 would skew positions.
        self.model.inv_freq = rope_inv_freq(self.args).to(self.torch_device)
        if self.lora_settings.enabled:
            self.loras = lora.LoraSet(self.lora_settings, self.model, self.torch_device, self.dtype)
            for name, path in self.lora_settings.modules:
                try:
                    self.loras.register(self.loras.read(name, path))
                except FerryError as exc:
                    raise ConfigError(f"model '{self.config.name}': parameter 'lora_modules': {exc}") from None
        self.tokenizer = TextTokenizer(self.folder)
        self.eos_token_ids = self.tokenizer.eos_token_ids or self.args.eos_token_ids
        self.guides, self.guides_error = None, ""
        try:
            self.guides = guided.Guides(self.tokenizer.tokenizer, self.args.vocab_size, tuple(self.eos_token_ids))
        except Exception as exc:  # noqa: BLE001 - the model still serves unconstrained requests
            self.guides_error = f"{type(exc).__name__}: {exc}"
            log.warning("model '%s': structured output is off, its tokenizer did not load in llguidance (%s)",
                        self.config.name, self.guides_error)
        self.max_model_len = min(self.settings.max_model_len or self.args.max_position, self.args.max_position)
        self.num_kv_blocks = self._num_blocks()
        self.caches = self._allocate_caches()
        a = self.args
        self.paged_kernel = paged_kernel.probe(self.torch_device, self.dtype, self.settings.block_size, a.num_heads,
                                               a.num_kv_heads, a.head_dim)
        # On a CPU, decodes read the paged cache in place (cpu_decode.py) where its kernel builds here.
        self.decode_kernel = None if self.paged_kernel else cpu_decode.load(self.torch_device, self.dtype,
                                                                            a.num_kv_heads, a.num_heads)
        self.generator = torch.Generator(device=self.torch_device)
        self.generator.manual_seed(0)
        log.info("model '%s': %s on %s (%s), %d KV blocks of %d tokens%s", self.config.name, self.args.model_type,
                 self.device, str(self.dtype).removeprefix("torch."), self.num_kv_blocks, self.settings.block_size,
                 f", sliding window {self.args.sliding_window}" if self.args.sliding_window else "")

    @property
    def released_window(self) -> int | None:
        """The window behind which KV blocks can be given back: only when every layer slides."""
        return self.args.sliding_window if all(self.args.sliding_layers) else None

    def _dtype(self) -> torch.dtype:
        chosen = self.settings.dtype
        if chosen == "auto":
            chosen = "float32" if self.device.kind == "cpu" else (self.args.dtype if self.args.dtype in _DTYPES else "bfloat16")
            if chosen == "float32" and self.device.kind == "cuda":
                chosen = "bfloat16"
        return _DTYPES[chosen]

    def _num_blocks(self) -> int:
        if self.settings.num_kv_blocks:
            return self.settings.num_kv_blocks
        a = self.args
        per_block = 2 * a.num_layers * self.settings.block_size * a.num_kv_heads * a.head_dim * self.dtype.itemsize
        budget = self.settings.kv_cache_memory_mb * 2**20
        if not budget and self.device.kind == "cuda":
            # As vLLM does: what is left of the allowed share once the weights are loaded goes to KV.
            free, total = torch.cuda.mem_get_info(self.device.index)
            used = total - free
            budget = int(total * self.settings.gpu_memory_utilization) - used
            if budget < per_block:
                raise ConfigError(f"{self.folder}: no GPU memory left for the KV cache ({free / 2**30:.1f} GiB free of "
                                  f"{total / 2**30:.1f}); lower the model size or raise gpu_memory_utilization")
        return max(1, (budget or 256 * 2**20) // per_block)

    def _allocate_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        slots = self.num_kv_blocks * self.settings.block_size
        shape = (slots, self.args.num_kv_heads, self.args.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.torch_device),
                 torch.zeros(shape, dtype=self.dtype, device=self.torch_device)) for _ in range(self.args.num_layers)]

    def encode_prompt(self, text: str | None, token_ids: list[int] | None) -> list[int]:
        ids = list(token_ids) if token_ids else self.tokenizer.encode(text or "")
        if not ids:
            raise InvalidInputError("the prompt is empty")
        if max(ids) >= self.args.vocab_size:
            raise InvalidInputError(f"token id {max(ids)} is outside the vocabulary (size {self.args.vocab_size})")
        return ids

    def start_guide(self, constraint: Constraint) -> guided.Guide:
        """A fresh matcher for one sequence; the first use of a constraint compiles it (a refusal is a 400)."""
        if self.guides is None:
            raise InvalidInputError(f"model '{self.config.name}' cannot constrain its output: its tokenizer is not "
                                    f"supported by the grammar engine ({self.guides_error})")
        return self.guides.start(constraint)

    def execute(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Never called: the factory gives a generation model a GenerationRunner, which calls `step`."""
        raise NotImplementedError("generation models run step by step")

    def step(self, plan: StepPlan) -> dict[int, int | list[int]]:
        """Run one forward pass over every planned token; return {seq_id: sampled token} for sequences
        whose plan brings them up to date (the others were fed a prompt chunk only), and for a sequence
        fed drafts (`plan.drafts`) the token chosen after each fed position from its pending token on."""
        ids, positions, slots = [], [], []
        decode, verify, prefill = [], [], []
        rows, samplers, histories = [], [], []  # one per chosen token: step row, sequence, its history
        bs = self.settings.block_size
        start = 0
        for seq, n in plan.entries:
            first = seq.num_computed
            drafts = plan.drafts.get(seq.seq_id, [])
            table = seq.block_table
            if n == 1:  # a decode, most of a wide step's entries: plain ints, no array operations per sequence
                ids.append(seq.token_ids[first])
                positions.append(first)
                slots.append(table[first // bs] * bs + first % bs)  # where its new K/V goes (a live block)
            else:
                ids.extend(seq.token_ids[first : first + n - len(drafts)])
                ids.extend(drafts)
                pos = np.arange(first, first + n)
                positions.extend(pos.tolist())
                slots.extend((np.asarray(table)[pos // bs] * bs + pos % bs).tolist())
            (decode if n == 1 else verify if drafts else prefill).append((start, n, first, table))
            if first + n == seq.num_tokens + len(drafts):
                for j in range(len(drafts) + 1):  # the choice after the pending token and after each draft
                    rows.append(start + n - 1 - len(drafts) + j)
                    samplers.append(seq)
                    histories.append(History(seq.token_ids + drafts[:j] if j else seq.token_ids, seq.prompt_len))
            start += n
        device = self.torch_device
        constrained = [i for i, seq in enumerate(samplers) if seq.guide is not None]
        masks = self.guides.masks([(samplers[i].guide, histories[i].output) for i in constrained],
                                  len(samplers)) if constrained else None
        meta = StepMetadata(torch.tensor(slots, dtype=torch.long, device=device), [])
        if self.loras is not None:
            meta.lora = self.loras.step([seq.lora for seq, _ in plan.entries], [n for _, n in plan.entries],
                                        device, self.dtype)
        if self.paged_kernel:  # every entry in step order: the kernel reads the queries packed as they are
            _, lengths, computed, tables = zip(*sorted(decode + verify + prefill, key=lambda e: e[0]))
            meta.varlen = paged_kernel.build_step(lengths, computed, tables, bs, device)
        else:
            window, full = self.args.sliding_window, not all(self.args.sliding_layers)
            skip: dict[int, int] = {}
            if window is None:  # blocks many sequences share: read once (shared_prefix.py)
                clusters, skip = shared_prefix.find(decode + verify + prefill, bs)
                meta.prefixes = shared_prefix.build(clusters, bs, device)
                self.shared_prefix_reads += sum(c.saved for c in clusters)
            kinds = (decode, verify, prefill)
            if self.decode_kernel is not None and decode and not meta.prefixes:  # (a shared prefix: read once, above)
                meta.decodes = self.decode_kernel.build_step([e[0] for e in decode], [e[2] for e in decode],
                                                             [e[3] for e in decode], bs, window)
                kinds = (verify, prefill)
            meta.groups = [build_group(*zip(*group), bs, device, window, full, self.dtype,
                                       [skip.get(e[0], 0) for e in group] if skip else None)
                           for kind in kinds for group in split_by_length(kind, skip)]
        with torch.inference_mode():
            logits = self.model(torch.tensor(ids, device=device), torch.tensor(positions, dtype=torch.long, device=device),
                                self.caches, meta, torch.tensor(rows, dtype=torch.long, device=device))
            if not samplers:
                return {}
            if masks is not None:  # computed on the mask thread while the forward pass ran (guided.py)
                logits = guided.apply(logits, constrained, self.guides.wait(masks))
            chosen, logprobs = choose(logits, [s.sampling for s in samplers], [len(h.token_ids) for h in histories],
                                      self.generator, histories, tuple(self.eos_token_ids))
        return self._collect(plan, samplers, chosen, logprobs)

    def _collect(self, plan: StepPlan, samplers: list, chosen: list[int], logprobs: dict) -> dict[int, int | list[int]]:
        """Rows back to sequences: one token each, or the list of choices of a drafted one; logprobs kept
        per sequence as a list, one per token chosen."""
        out: dict[int, int | list[int]] = {}
        for row, (seq, token) in enumerate(zip(samplers, chosen)):
            if seq.seq_id in plan.drafts:
                out.setdefault(seq.seq_id, []).append(token)
            else:
                out[seq.seq_id] = token
            if row in logprobs:
                self.logprobs.setdefault(seq.seq_id, []).append(logprobs[row])
        return out

    def take_logprobs(self) -> dict[int, list[TokenLogprobs]]:
        """{seq_id: logprobs, one per token chosen} since the last call, for sequences that asked. Kept
        beside `step`'s tokens so a step's result stays tokens only, for the isolation re-runs."""
        taken, self.logprobs = self.logprobs, {}
        return taken

    def held(self) -> tuple:
        return (self.model,) if getattr(self, "model", None) is not None else ()

    def unload(self) -> None:
        self.model = None
        if getattr(self, "guides", None) is not None:
            self.guides.close()
        self.caches = []
        if self.device.kind == "cuda":
            torch.cuda.empty_cache()

    def describe(self) -> dict[str, str]:
        return {"device": str(self.device), "dtype": str(self.dtype).removeprefix("torch."),
                "num_kv_blocks": str(self.num_kv_blocks), "max_model_len": str(self.max_model_len),
                "attention": "paged flash (varlen_attn)" if self.paged_kernel else
                "decodes in place (CPU kernel), prompts gather + SDPA" if self.decode_kernel else "gather + SDPA",
                "linear": "oneDNN" if self.onednn_linear else "torch"}
