"""Prometheus metrics of one server (`GET /metrics`; request path stage 10 and the startup chain).

Owns: a private prometheus_client registry with two kinds of series.
  * measured in the main process per request: TTFT, TPOT, inter-token latency, end-to-end latency
    histograms; requests received / finished (by finish_reason) / aborted; HTTP errors by status.
  * reported by the scheduler process (its `stats()` and the engine COUNTERS, fetched fresh for each
    scrape): running/waiting requests, KV pool pages used/cached/free/total, prefix-cache hit tokens,
    evicted pages, preemptions, prompt/generation tokens, steps, CUDA-graph replays vs eager fallbacks
    (by reason), and every other engine counter as `dsaserve_engine_counter{name}`.
Each help says what is counted where two series look alike: engine requests include the /health probes
(`dsaserve_health_probes`); engine aborts are per prompt and exclude stop-string endings, HTTP aborts
are per request; KV pages used + cached + free = total.
Plus readiness (`dsaserve_up`) and the startup manifest's seconds per phase.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# Buckets in seconds: sub-ms (CPU tiny model, H200 decode) up to minutes (1M-token prefill).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TOKEN_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

# scheduler stats key -> (metric name, help); gauges are levels, counters are running totals
ENGINE_GAUGES = {
    "num_running": ("dsaserve_num_requests_running", "samples holding KV pages in the scheduler"),
    "num_waiting": ("dsaserve_num_requests_waiting", "samples waiting in the scheduler (new or preempted)"),
    "kv_pages_used": ("dsaserve_kv_pages_used", "KV pool pages referenced by live requests "
                      "(used + cached + free = total)"),
    "kv_pages_cached": ("dsaserve_kv_pages_cached", "KV pool pages held only by the prefix cache: no live request "
                        "references them, evictable (LRU)"),
    "kv_pages_free": ("dsaserve_kv_pages_free", "KV pool pages free"),
    "kv_pages_total": ("dsaserve_kv_pages_total", "KV pool pages in all (allocated once at startup)"),
    "overlap_schedule": ("dsaserve_overlap_schedule", "1 when the engine overlaps scheduling with the device "
                         "(engine/overlap.py), 0 when it steps synchronously"),
    "kv_pages_in_prefix_cache": ("dsaserve_kv_pages_in_prefix_cache", "KV pool pages registered in the prefix "
                                 "cache, referenced by live requests or not (overlaps used)"),
}
ENGINE_COUNTERS = {
    "prefix_cache_hit_tokens": ("dsaserve_prefix_cache_hit_tokens", "prompt tokens served by the prefix cache"),
    "evicted_pages": ("dsaserve_evicted_pages", "prefix-cache pages evicted (LRU)"),
    "preemptions": ("dsaserve_preemptions", "running samples preempted to free KV pages"),
    "prompt_tokens": ("dsaserve_prompt_tokens", "prompt tokens admitted by the scheduler"),
    "generation_tokens": ("dsaserve_generation_tokens", "tokens generated"),
    "computed_tokens": ("dsaserve_computed_tokens", "tokens run through the model (prefill + decode)"),
    "steps": ("dsaserve_engine_steps", "engine steps with a forward"),
    "requests": ("dsaserve_engine_requests", "engine requests the scheduler admitted: one per prompt of each "
                 "HTTP request, plus every /health probe (dsaserve_health_probes)"),
    "aborted": ("dsaserve_engine_aborted_requests", "engine requests aborted whole in the scheduler (client gone, "
                "error, drain timeout, /health probe timeout), one per prompt; dsaserve_requests_aborted counts "
                "HTTP requests"),
    "grammar_compiles": ("dsaserve_grammar_compiles", "structured-output grammars compiled (cache misses)"),
    "grammar_cache_hits": ("dsaserve_grammar_cache_hits", "structured-output grammars found in the cache"),
    "grammar_compile_failures": ("dsaserve_grammar_compile_failures", "grammars that did not compile (400s)"),
    "grammar_compile_timeouts": ("dsaserve_grammar_compile_timeouts", "grammars past --grammar-compile-timeout"),
    "overlap_steps": ("dsaserve_overlap_steps", "steps launched before the previous step's tokens reached the host "
                      "(overlap scheduling; 0 with --disable-overlap-schedule)"),
    "overlap_discarded_tokens": ("dsaserve_overlap_discarded_tokens", "tokens computed or sampled for a sample that "
                                 "had already finished (a stop token or an abort found one step late under overlap "
                                 "scheduling); never emitted nor counted in usage"),
    "spec_draft_tokens": ("dsaserve_spec_decode_num_draft_tokens", "draft tokens the MTP layer proposed and a "
                          "decode step verified (speculative decoding, engine/mtp.py)"),
    "spec_accepted_tokens": ("dsaserve_spec_decode_num_accepted_tokens", "draft tokens kept: the sampler drew the "
                             "draft itself at its position (accepted / draft = the acceptance rate)"),
    "spec_num_drafts": ("dsaserve_spec_decode_num_drafts", "request-steps that verified drafts (accepted_per_pos / "
                        "this = the acceptance at each position)"),
    "aborted_samples": ("dsaserve_engine_stop_string_samples", "samples the detokenizer ended in the scheduler "
                        "because a stop string matched (a normal finish, not a failure)"),
}


class EngineCollector(Collector):
    """Series from the latest scheduler snapshot ({"stats": core.stats(), "counters": COUNTERS})."""

    def __init__(self, readiness: Any) -> None:
        self.readiness = readiness
        self.snapshot: dict[str, Any] = {}

    def collect(self):
        stats = self.snapshot.get("stats") or {}
        counters = self.snapshot.get("counters") or {}
        yield GaugeMetricFamily("dsaserve_up", "1 when the server is Up (ready for traffic)",
                                value=1.0 if self.readiness.is_up else 0.0)
        for key, (name, help_) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, help_, value=float(stats.get(key, 0) or 0))
        total = float(stats.get("kv_pages_total", 0) or 0)
        used = float(stats.get("kv_pages_used", 0) or 0)
        yield GaugeMetricFamily("dsaserve_kv_cache_usage_ratio", "kv_pages_used / kv_pages_total",
                                value=used / total if total else 0.0)
        for key, (name, help_) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, help_, value=float(stats.get(key, 0) or 0))
        per_pos = CounterMetricFamily("dsaserve_spec_decode_num_accepted_tokens_per_pos", "draft tokens kept at each "
                                      "position of a request's drafts (1 = the MTP layer's first)", labels=["position"])
        for j, n in enumerate(stats.get("spec_accepted_per_pos") or []):
            per_pos.add_metric([str(j + 1)], float(n))
        yield per_pos
        yield from _graph_counters(counters)
        fam = GaugeMetricFamily("dsaserve_engine_counter", "engine COUNTERS (common/counters.py), by name",
                                labels=["name"])
        for k in sorted(counters):
            fam.add_metric([k], float(counters[k]))
        yield fam
        phases = GaugeMetricFamily("dsaserve_startup_phase_seconds", "seconds of each startup phase",
                                   labels=["phase"])
        for k, v in sorted(self.readiness.startup_time().items()):
            phases.add_metric([k], float(v))
        yield phases


def _graph_counters(counters: dict[str, float]):
    yield CounterMetricFamily("dsaserve_graph_replays", "decode CUDA-graph replays",
                              value=float(counters.get("graph_replays", 0)))
    yield CounterMetricFamily("dsaserve_piecewise_replays", "steps with a prefill part replayed on piecewise "
                              "CUDA graphs (attention cores eager between the segments)",
                              value=float(counters.get("piecewise_replays", 0)))
    reasons = {k.split(".", 1)[1]: v for k, v in counters.items() if k.startswith("eager_fallbacks.")}
    yield CounterMetricFamily("dsaserve_eager_fallbacks", "forwards that ran eagerly although CUDA graphs were "
                              "captured (a prefill step past the largest piecewise bucket, ...), all reasons; "
                              "0 without graphs "
                              "(CPU, --disable-cuda-graph): every forward is eager there, see "
                              "dsaserve_engine_counter{name=\"forward_steps\"}",
                              value=float(sum(reasons.values()) + counters.get("eager_fallbacks", 0)))
    fam = CounterMetricFamily("dsaserve_eager_fallback_reason", "eager (non-graph) forwards by reason",
                              labels=["reason"])
    for reason, v in sorted(reasons.items()):
        fam.add_metric([reason], float(v))
    yield fam


class FirstVsSteadyTTFT:
    """Cold-path visibility (note 000: "首请求 TTFT 与稳态 p50 的比值"): per prompt shape (power-of-two
    bucket of prompt tokens), the TTFT of the first request of that shape against the median of the later
    ones. A first/steady ratio well above 1 for a shape warmup covered points at a cold path."""

    KEEP = 64  # later TTFTs kept per shape for the median

    def __init__(self, registry: CollectorRegistry) -> None:
        lab = ["prompt_bucket"]
        self.first = Gauge("dsaserve_ttft_first_request_seconds", "TTFT of the first request of this prompt shape",
                           lab, registry=registry)
        self.steady = Gauge("dsaserve_ttft_steady_median_seconds", "median TTFT of later requests of this shape",
                            lab, registry=registry)
        self.ratio = Gauge("dsaserve_ttft_first_over_steady", "first-request TTFT / steady median, per shape",
                           lab, registry=registry)
        self.later: dict[str, deque[float]] = {}
        self.first_seen: dict[str, float] = {}

    @staticmethod
    def bucket(prompt_tokens: int) -> str:
        return f"le_{1 << max(prompt_tokens - 1, 0).bit_length()}"

    def observe(self, seconds: float, prompt_tokens: int) -> None:
        b = self.bucket(prompt_tokens)
        if b not in self.first_seen:
            self.first_seen[b], self.later[b] = seconds, deque(maxlen=self.KEEP)
            self.first.labels(prompt_bucket=b).set(seconds)
            return
        self.later[b].append(seconds)
        median = statistics.median(self.later[b])
        self.steady.labels(prompt_bucket=b).set(median)
        self.ratio.labels(prompt_bucket=b).set(self.first_seen[b] / median if median > 0 else 0.0)


class ServerMetrics:
    def __init__(self, readiness: Any) -> None:
        disable_created_metrics()  # no `_created` series: they double the page and no dashboard reads them
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("dsaserve_time_to_first_token_seconds", "arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dsaserve_time_per_output_token_seconds",
                              "(last token - first token) / (output tokens - 1), per sample",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("dsaserve_inter_token_latency_seconds", "time between output tokens",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("dsaserve_e2e_request_latency_seconds", "arrival to last output token, per sample",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.received = Counter("dsaserve_requests_received", "prompts of accepted generation requests (an HTTP "
                                "request with a list of prompts counts each; n samples of one prompt count once)",
                                registry=r)
        self.prompts = Counter("dsaserve_request_prompt_tokens", "prompt tokens of accepted requests", registry=r)
        self.finished = Counter("dsaserve_requests_finished", "samples finished, by finish_reason",
                                ["finish_reason"], registry=r)
        self.aborted = Counter("dsaserve_requests_aborted", "HTTP requests aborted before they finished (client "
                               "disconnect, engine error, drain timeout), once per request", registry=r)
        self.health_probes = Counter("dsaserve_health_probes", "/health 1-token probes sent through the engine "
                                     "(they are in dsaserve_engine_requests too)", registry=r)
        self.http_errors = Counter("dsaserve_http_errors", "error responses, by HTTP status", ["status"],
                                   registry=r)
        self.first_vs_steady = FirstVsSteadyTTFT(r)
        self.engine = EngineCollector(readiness)
        r.register(self.engine)

    # ---- hooks the TokenizerManager / API call ------------------------------------------------
    def request_started(self, num_prompts: int, prompt_tokens: int) -> None:
        self.received.inc(num_prompts)
        self.prompts.inc(prompt_tokens)

    def request_aborted(self) -> None:
        self.aborted.inc()

    def health_probe_sent(self) -> None:
        self.health_probes.inc()

    def observe_ttft(self, seconds: float, prompt_tokens: int | None = None) -> None:
        self.ttft.observe(seconds)
        if prompt_tokens is not None:
            self.first_vs_steady.observe(seconds, prompt_tokens)

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def sample_finished(self, reason: str | None, e2e: float, timing: Any) -> None:
        self.finished.labels(finish_reason=reason or "unknown").inc()
        self.e2e.observe(e2e)
        if timing.tokens > 1 and timing.first is not None and timing.last is not None:
            self.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))

    def http_error(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def render(self, snapshot: dict[str, Any]) -> bytes:
        if snapshot:
            self.engine.snapshot = snapshot
        return generate_latest(self.registry)
