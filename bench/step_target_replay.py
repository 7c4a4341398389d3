"""The step-time target's scheduler replayed against a step cost line: no engine, no clock, no noise.

    python -m bench.step_target_replay [--fixed-ms 15] [--decode-ms 0.6] [--prompt-ms 0.28]
                                       [--first-step 1,5,15,48] [--max-step-ms 50,100]

Not a benchmark: it measures nothing. It runs the real ContinuousScheduler on the burst of
bench/generation.py (48 requests at once) and charges every step fixed + decode x decodes + prompt x
prompt tokens (defaults chosen to match the quiet burst run in bench/RESULTS.md: decode steps ~40 ms,
a 1,024-token step ~300 ms), feeding those costs back as the runner does. `--first-step` is how many of
the requests the server's first step catches (the rest arrive while it runs), which a real burst over
gRPC decides by timing. Each target runs with the burst-onset rule (step_budget.ONSET) and without it,
so what the rule changes and what is left to arithmetic can be read apart on a shared machine where a
measured run cannot tell them. Figures in simulated milliseconds; ratios against no target.
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.generation import workload
from server.scheduling.continuous import ContinuousScheduler, ContinuousSettings
from server.scheduling.kv_blocks import KVBlockPool
from server.scheduling.sequence import SamplingParams, Sequence


def replay(args, max_step_ms: float, first: int, onset: bool) -> dict:
    settings = ContinuousSettings(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=1024,
                                  max_step_ms=max_step_ms)
    s = ContinuousScheduler(settings, KVBlockPool(1024, 16))
    if not onset:
        s.step_budget.onset = 0
    seqs = [Sequence(i, p, len(p), SamplingParams(max_tokens=n, ignore_eos=True)) for i, (p, n) in enumerate(workload(48))]
    late = seqs[first:]
    for seq in seqs[:first]:
        s.submit(seq)
    now, first_token, last, itl = 0.0, {}, {}, []
    while s.running or s.num_waiting or late:
        plan = s.schedule()
        cost = args.fixed_ms + args.decode_ms * plan.decodes + args.prompt_ms * plan.prompt_tokens
        now += cost
        sampled = {q.seq_id: 7 for q, n in plan.entries if q.num_computed + n >= q.num_tokens}
        s.postprocess(plan, sampled)
        s.observe_step(plan, cost)
        for i in sampled:
            (itl.append(now - last[i]) if i in first_token else first_token.__setitem__(i, now))
            last[i] = now
        for seq in late:
            s.submit(seq)
        late = []
    ttft = list(first_token.values())
    return {"ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99), "itl_p99": np.percentile(itl, 99),
            "tok_s": sum(q.num_output for q in seqs) / now * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed-ms", type=float, default=15.0)
    parser.add_argument("--decode-ms", type=float, default=0.6)
    parser.add_argument("--prompt-ms", type=float, default=0.28)
    parser.add_argument("--first-step", default="1,5,15,48", help="requests the first step catches (comma-separated)")
    parser.add_argument("--max-step-ms", default="50,100")
    args = parser.parse_args()
    print("| first step | max_step_ms | onset rule | ttft p50 / none | ttft p99 / none | itl p99 ms | tok/s / none |")
    print("|---|---|---|---|---|---|---|")
    for first in (int(x) for x in args.first_step.split(",")):
        none = replay(args, 0.0, first, True)
        for ms in (float(x) for x in args.max_step_ms.split(",")):
            for onset in (False, True):
                r = replay(args, ms, first, onset)
                print(f"| {first} | {ms:g} | {'on' if onset else 'off'} | {r['ttft_p50'] / none['ttft_p50']:.2f} | "
                      f"{r['ttft_p99'] / none['ttft_p99']:.2f} | {r['itl_p99']:.0f} | {r['tok_s'] / none['tok_s']:.2f} |")


if __name__ == "__main__":
    main()
