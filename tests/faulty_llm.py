"""A test model backend: Ferry's own LLM backend, except that a step feeding a prompt token named by the
config's `poison_token_id` parameter raises, as a model that cannot handle one client's input would.

No validated input makes the real engine raise any more (the decoder and the per-row sampler see to
that), so the generation isolation tests need a model that still does. It runs the real forward pass
first (the K/V of every entry, the poisoned one's included, are written) and raises after, so a
re-run must cope with a cache the raising pass already wrote into. Serve it with
`python -m tests.faulty_llm serve ...`: it replaces the `llm` backend of that server process only.
"""

from __future__ import annotations

from server import backends
from server.backends.llm.engine import LLMBackend
from server.scheduling.continuous import StepPlan


class FaultyLLMBackend(LLMBackend):
    def load(self) -> None:
        super().load()
        poison = self.config.parameters.get("poison_token_id")
        self.poison = int(poison.string_value) if poison is not None else None

    def step(self, plan: StepPlan) -> dict[int, int]:
        sampled = super().step(plan)
        for seq, n in plan.entries:
            if self.poison in seq.token_ids[seq.num_computed : min(seq.num_computed + n, seq.prompt_len)]:
                raise IndexError(f"token {self.poison}: index out of range in self")
        return sampled


if __name__ == "__main__":
    backends._BACKENDS["llm"] = f"{__spec__.name}:FaultyLLMBackend"
    from server.__main__ import main

    main()
