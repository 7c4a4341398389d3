"""One generation request as the continuous-batching scheduler sees it: token counts, status, blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


DEFAULT_MAX_TOKENS = 256  # tokens generated when neither the request nor the model's config says


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match (runners/constraints.py builds it; backends/llm/guided.py compiles it).
    `kind`: json (a JSON schema as canonical JSON text), regex, choice (a JSON list of strings) or
    grammar (Lark or GBNF text). Hashable, so one compiled grammar serves every request that asks the same."""

    kind: str
    spec: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0  # eos and stop token ids cannot end the output before this many tokens
    repetition_penalty: float = 1.0  # 1: off; prompt and output tokens (as vLLM and transformers)
    presence_penalty: float = 0.0  # 0: off; output tokens only (as vLLM and OpenAI)
    frequency_penalty: float = 0.0  # 0: off; output tokens only, per occurrence
    logprobs: int | None = None  # None: none; n: the sampled token's logprob and the top n
    constraint: Constraint | None = None  # structured output: tokens outside it are masked before sampling

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(slots=True, eq=False)
class Sequence:
    """Mutable record of one request. The scheduler moves it between queues and counts tokens; only the
    block pool writes `block_table` and `block_hashes`; the runner only reads it."""

    seq_id: int
    token_ids: list[int]  # prompt followed by every token generated so far
    prompt_len: int
    sampling: SamplingParams
    priority: int = 1  # 1 is the highest
    arrival_ns: int = 0
    deadline_ns: int | None = None
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose K/V sit in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # names of its full computed blocks (kv_blocks.py)
    finish_reason: str | None = None
    preemptions: int = 0
    admitted: int = 0  # admission order among running sequences; later admitted is preempted first
    cancelled: bool = False
    handle: Any = None  # the engine's per-request channel; opaque to the scheduler
    guide: Any = None  # the grammar matcher of a constrained sequence (backends/llm/guided.py); only the engine reads it
    lora: Any = None  # the LoRA adapter it runs with (backends/llm/lora.py); only the engine reads it
    lora_key: bytes = b""  # that adapter's identity (b"": the base model): its prefix-cache seed, its admission group

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens to feed before the next token can be sampled."""
        return self.num_tokens - self.num_computed
