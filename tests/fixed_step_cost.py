"""A test launcher: Ferry, except that every generation step is charged a fixed cost per token to the
step-time target's cost model (scheduling/step_budget.py) instead of what the step measured.

The step-time target sizes prompt chunks from measured step times, which depend on the machine and its
load; with this cost the chunk sizes follow from the config alone, so a test can assert them exactly.
The fit itself still runs on these figures. Serve with `python -m tests.fixed_step_cost serve ...`.
"""

from __future__ import annotations

from server.scheduling.step_budget import StepCost

MS_PER_TOKEN = 1.0  # a line through 0, so the fit is exact from the first step: max_step_ms N allows N tokens


def _charged(observe):
    def observe_fixed(self: StepCost, decodes: int, prompt_tokens: int, ms: float) -> None:
        observe(self, decodes, prompt_tokens, MS_PER_TOKEN * (decodes + prompt_tokens))

    return observe_fixed


if __name__ == "__main__":
    StepCost.observe = _charged(StepCost.observe)
    from server.__main__ import main

    main()
