"""Figures of generation models: KV cache, queue, preemptions and token latencies.

Kept beside metrics.py (which owns the KServe figures every model shares) so the two can grow apart;
histograms are in microseconds like the rest of Ferry's, measured on one monotonic clock in the engine.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from server.observability.vllm_metrics import LATENCIES, VllmFamilies

_LABELS = ("model", "version")
# counter name -> PrefixCacheStats field (scheduling/prefix_cache.py)
_PREFIX_COUNTERS = {"prefix_query_tokens": "query_tokens", "prefix_hit_tokens": "hit_tokens",
                    "prefix_query_blocks": "query_blocks", "prefix_hit_blocks": "hit_blocks",
                    "prefix_evictions": "evictions"}
_STEP_TOKEN_BUCKETS = tuple(2**i for i in range(13))  # 1 .. 4096 tokens
# counter name -> SpeculativeStats field (scheduling/speculative.py); vLLM's spec_decode names
_SPEC_COUNTERS = {"spec_drafts": "drafts", "spec_draft_tokens": "draft_tokens", "spec_accepted_tokens": "accepted_tokens"}
# PrefixCacheStats counter -> the vLLM counter of the same tokens
_VLLM_PREFIX = {"prefix_query_tokens": "prefix_queries", "prefix_hit_tokens": "prefix_hits"}
# counter name -> guided.GuidedStats field (backends/llm/guided.py)
_GUIDED_COUNTERS = {"guided_rows": "rows", "guided_mixed_steps": "mixed_steps", "guided_compiles": "compiles",
                    "guided_compile_us": "compile_us", "guided_mask_wait_us": "mask_wait_us"}
_LORA_COUNTERS = {"lora_mixed_steps": "mixed_steps", "lora_loads": "loads", "lora_evictions": "evictions"}
_TOKEN_BUCKETS_US = (1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 10_000_000)


class GenerationFamilies:
    def __init__(self, registry: CollectorRegistry):
        def gauge(name, doc):
            return Gauge(name, doc, _LABELS, registry=registry)

        def histogram(name, doc):
            return Histogram(name, doc, _LABELS, buckets=_TOKEN_BUCKETS_US, registry=registry)

        self.running = gauge("ferry_generation_running", "Sequences in the running batch")
        self.waiting = gauge("ferry_generation_waiting", "Sequences waiting to be admitted")
        self.kv_used = gauge("ferry_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = gauge("ferry_kv_blocks_total", "KV cache blocks in the pool")
        self.fragmentation = gauge("ferry_kv_fragmentation", "Allocated but unfilled KV slots / allocated slots")
        self.prompt_tokens = Counter("ferry_prompt_tokens", "Prompt tokens of the sequences that reached their first "
                                     "token (cached prefix tokens included, as vLLM counts them)", _LABELS, registry=registry)
        self.generation_tokens = Counter("ferry_generation_tokens", "Tokens generated", _LABELS, registry=registry)
        self.preemptions = Counter("ferry_preemptions", "Sequences preempted (freed and later recomputed)", _LABELS, registry=registry)
        self.step_reruns = Counter("ferry_generation_step_reruns", "Extra model passes spent isolating the sequences "
                                   "a raising step failed on (the others were kept)", _LABELS, registry=registry)
        self.kv_cached = gauge("ferry_kv_blocks_cached", "KV blocks holding a cached prompt prefix (in use or idle)")
        for unit in ("tokens", "blocks"):
            setattr(self, f"prefix_query_{unit}", Counter(
                f"ferry_prefix_cache_query_{unit}", f"Prompt {unit} looked up in the prefix cache at admission "
                "(blocks: full blocks before the last token)", _LABELS, registry=registry))
            setattr(self, f"prefix_hit_{unit}", Counter(
                f"ferry_prefix_cache_hit_{unit}", f"Prompt {unit} the prefix cache supplied (not computed)",
                _LABELS, registry=registry))
            setattr(self, f"prefix_hit_rate_{unit}", gauge(
                f"ferry_prefix_cache_hit_rate_{unit}", f"Hit {unit} / query {unit} since the model loaded"))
        self.prefix_evictions = Counter("ferry_prefix_cache_evictions", "Idle cached KV blocks reused for other "
                                        "tokens (least recently used first)", _LABELS, registry=registry)
        self.shared_prefix_reads = Counter(
            "ferry_attention_shared_prefix_saved_key_reads", "Key reads a layer saved by attending a cached prefix "
            "once for every sequence of a step that shares it (shared-prefix attention), summed over steps",
            _LABELS, registry=registry)
        self.spec_drafts = Counter("ferry_spec_decode_num_drafts", "Speculative decoding: steps a sequence was fed "
                                   "drafts in", _LABELS, registry=registry)
        self.spec_draft_tokens = Counter("ferry_spec_decode_num_draft_tokens", "Speculative decoding: draft tokens "
                                         "checked", _LABELS, registry=registry)
        self.spec_accepted_tokens = Counter("ferry_spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens "
                                            "the model agreed with (kept)", _LABELS, registry=registry)
        self.spec_acceptance_rate = gauge("ferry_spec_decode_acceptance_rate", "Accepted / drafted tokens since the model loaded")
        self.guided_rows = Counter("ferry_structured_output_tokens", "Tokens chosen under a structured-output "
                                   "constraint (a grammar mask)", _LABELS, registry=registry)
        self.guided_mixed_steps = Counter("ferry_structured_output_mixed_steps", "Steps that chose tokens for "
                                          "constrained and unconstrained sequences together", _LABELS, registry=registry)
        self.guided_compiles = Counter("ferry_structured_output_compiles", "Constraints compiled (a cached one "
                                       "compiles nothing)", _LABELS, registry=registry)
        self.guided_compile_us = Counter("ferry_structured_output_compile_us", "Time spent compiling constraints",
                                         _LABELS, registry=registry)
        self.guided_mask_wait_us = Counter("ferry_structured_output_mask_wait_us", "Time steps waited for grammar "
                                           "masks after their forward pass (masks are computed during it)",
                                           _LABELS, registry=registry)
        self.lora_mixed_steps = Counter("ferry_lora_mixed_steps", "Steps whose rows used more than one LoRA adapter "
                                        "(the base model counting as one)", _LABELS, registry=registry)
        self.lora_loads = Counter("ferry_lora_loads", "LoRA adapters read into a resident slot", _LABELS, registry=registry)
        self.lora_evictions = Counter("ferry_lora_evictions", "Resident LoRA adapters dropped to make room for another",
                                      _LABELS, registry=registry)
        self.queue_us = histogram("ferry_generation_queue_duration_us", "Arrival to first scheduled step")
        self.ttft_us = histogram("ferry_time_to_first_token_us", "Arrival to first generated token")
        self.itl_us = histogram("ferry_inter_token_latency_us", "Time between consecutive tokens of a sequence")
        self.e2e_us = histogram("ferry_generation_duration_us", "Arrival to last token")
        self.step_us = histogram("ferry_generation_step_duration_us", "One scheduling step: plan, model step, "
                                 "streaming its tokens (what a decode waits between two tokens)")
        self.step_tokens = Histogram("ferry_generation_step_tokens", "Tokens one model step computed (decodes plus "
                                     "prompt chunks)", _LABELS, buckets=_STEP_TOKEN_BUCKETS, registry=registry)
        self.vllm = VllmFamilies(registry)  # the same figures under vLLM's names


class GenerationStats:
    """One model version's view of the families (label children resolved once)."""

    def __init__(self, families: GenerationFamilies | None, model: str, version: int):
        self.preemptions = 0
        self.step_reruns = 0
        self._c = self._v = None
        if families is not None:
            self._v = families.vllm.children(model)
            labels = {"model": model, "version": str(version)}
            self._c = {name: getattr(families, name).labels(**labels) for name in (
                "running", "waiting", "kv_used", "kv_total", "fragmentation", "preemptions", "step_reruns",
                "queue_us", "ttft_us", "itl_us", "e2e_us", "step_us", "step_tokens", "kv_cached", *_PREFIX_COUNTERS,
                "prefix_hit_rate_tokens", "prefix_hit_rate_blocks", *_SPEC_COUNTERS, "spec_acceptance_rate",
                "shared_prefix_reads", "prompt_tokens", "generation_tokens", *_GUIDED_COUNTERS, *_LORA_COUNTERS)}
        self._prefix_seen = dict.fromkeys(_PREFIX_COUNTERS, 0)
        self._spec_seen = dict.fromkeys(_SPEC_COUNTERS, 0)
        self._shared_reads_seen = 0
        self._guided_seen = dict.fromkeys(_GUIDED_COUNTERS, 0.0)
        self._lora_seen = dict.fromkeys(_LORA_COUNTERS, 0)

    def set_state(self, running: int, waiting: int, kv_used: int, kv_total: int, fragmentation: float, preemptions: int) -> None:
        added, self.preemptions = preemptions - self.preemptions, preemptions
        if self._c:
            for name, value in (("running", running), ("waiting", waiting), ("kv_used", kv_used),
                                ("kv_total", kv_total), ("fragmentation", fragmentation)):
                self._c[name].set(value)
            for name, value in (("running", running), ("waiting", waiting), ("kv_usage", kv_used / kv_total if kv_total else 0.0)):
                self._v[name].set(value)
            if added:
                self._c["preemptions"].inc(added)

    def set_prefix_cache(self, cached_blocks: int, stats) -> None:
        """`stats`: the pool's PrefixCacheStats (running totals); counters advance by what is new."""
        if not self._c:
            return
        self._c["kv_cached"].set(cached_blocks)
        for name, field in _PREFIX_COUNTERS.items():
            total = getattr(stats, field)
            if total > self._prefix_seen[name]:
                self._c[name].inc(total - self._prefix_seen[name])
                if name in _VLLM_PREFIX:
                    self._v[_VLLM_PREFIX[name]].inc(total - self._prefix_seen[name])
                self._prefix_seen[name] = total
        for unit in ("tokens", "blocks"):
            queries = getattr(stats, f"query_{unit}")
            self._c[f"prefix_hit_rate_{unit}"].set(getattr(stats, f"hit_{unit}") / queries if queries else 0.0)

    def set_speculative(self, stats) -> None:
        """`stats`: the speculator's SpeculativeStats (running totals); counters advance by what is new."""
        if not self._c:
            return
        for name, field in _SPEC_COUNTERS.items():
            total = getattr(stats, field)
            if total > self._spec_seen[name]:
                self._c[name].inc(total - self._spec_seen[name])
                self._spec_seen[name] = total
        if stats.draft_tokens:
            self._c["spec_acceptance_rate"].set(stats.accepted_tokens / stats.draft_tokens)

    def set_guided(self, stats) -> None:
        """`stats`: the engine's GuidedStats (running totals); counters advance by what is new."""
        if not self._c:
            return
        for name, field in _GUIDED_COUNTERS.items():
            total = getattr(stats, field)
            if total > self._guided_seen[name]:
                self._c[name].inc(total - self._guided_seen[name])
                self._guided_seen[name] = total

    def set_lora(self, stats) -> None:
        """`stats`: the engine's LoraStats (running totals); counters advance by what is new."""
        if not self._c:
            return
        for name, field in _LORA_COUNTERS.items():
            total = getattr(stats, field)
            if total > self._lora_seen[name]:
                self._c[name].inc(total - self._lora_seen[name])
                self._lora_seen[name] = total

    def set_shared_prefix_reads(self, total: int) -> None:
        """`total`: the engine's running count of key reads saved by shared-prefix attention."""
        if self._c and total > self._shared_reads_seen:
            self._c["shared_prefix_reads"].inc(total - self._shared_reads_seen)
            self._shared_reads_seen = total

    def count_reruns(self, passes: int) -> None:
        self.step_reruns += passes
        if self._c:
            self._c["step_reruns"].inc(passes)

    def observe_step(self, tokens: int, ns: int) -> None:
        if self._c:
            self._c["step_tokens"].observe(tokens)
            self._c["step_us"].observe(ns / 1000)

    def observe(self, name: str, ns: int) -> None:
        if self._c:
            self._c[name].observe(ns / 1000)
            if name in LATENCIES:
                self._v[LATENCIES[name]].observe(ns / 1e9)

    def count_tokens(self, prompt: int, generated: int) -> None:
        """A sequence's prompt (counted once, at its first token) and newly generated tokens."""
        if self._c:
            if prompt:
                self._c["prompt_tokens"].inc(prompt)
                self._v["prompt_tokens"].inc(prompt)
            if generated:
                self._c["generation_tokens"].inc(generated)
                self._v["generation_tokens"].inc(generated)
