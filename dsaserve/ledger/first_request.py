"""The first request after deployment: steady-state time plus the cold paths it alone pays (note 000:
T_first ~ T_steady(s, n) + sum over cold paths k of C_k).

Owns: which cold paths a first request can hit and what each costs — eager decode when the batch is
above the largest captured CUDA-graph bucket (every kernel launched from Python: operators x launch
overhead per step), prefill shapes warmup did not cover (compile / autotune), a first-use grammar, and
the empty prefix cache (the whole prompt is prefilled). Startup-chain steps it audits: warmup and graph
capture. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.ledger.deployment import Assumptions


@dataclass(frozen=True)
class ColdPath:
    key: str
    name: str
    seconds: float
    hit: bool  # does this first request pay it under the given inputs
    why: str


@dataclass(frozen=True)
class FirstRequest:
    steady_ttft_s: float  # prefill lower bound with the prefix-cache hit
    cold_ttft_s: float  # prefill lower bound of the whole prompt
    steady_tpot_s: float  # decode step (graph replay)
    eager_step_extra_s: float  # launches x overhead - one replay
    launches_per_step: float
    tokens: int
    paths: tuple[ColdPath, ...]

    @property
    def steady_s(self) -> float:
        return self.steady_ttft_s + self.tokens * self.steady_tpot_s

    @property
    def first_s(self) -> float:
        return self.steady_s + sum(p.seconds for p in self.paths if p.hit)


def first_request(asm: Assumptions, batch: int, launches: float, steady_tpot_s: float, steady_ttft_s: float,
                  cold_ttft_s: float) -> FirstRequest:
    n = asm.first_request_tokens
    extra = max(launches - 1, 0) * asm.launch_overhead_s  # eager: every kernel; replay: one launch
    eager = batch > asm.cuda_graph_max_bs
    paths = (
        ColdPath("eager_decode", f"eager decode (batch {batch} > cuda_graph_max_bs {asm.cuda_graph_max_bs})"
                 if eager else f"eager decode (not hit: batch {batch} <= cuda_graph_max_bs {asm.cuda_graph_max_bs})",
                 n * extra, eager, f"{launches:,.0f} launches x {asm.launch_overhead_s * 1e6:.1f} us per step x "
                 f"{n} tokens"),
        ColdPath("prefill_compile", "prefill shapes not covered by warmup",
                 asm.uncovered_prefill_shapes * asm.compile_s_per_shape, asm.uncovered_prefill_shapes > 0,
                 f"{asm.uncovered_prefill_shapes} shapes x {asm.compile_s_per_shape} s compile/autotune"),
        ColdPath("grammar", "first use of a JSON schema", asm.grammar_compile_s, asm.grammar_compile_s > 0,
                 "grammar compiled to an automaton once per schema"),
        ColdPath("prefix_cache", "empty prefix cache (whole prompt prefilled)", cold_ttft_s - steady_ttft_s,
                 cold_ttft_s > steady_ttft_s, "steady requests reuse the shared prefix's pages"),
    )
    return FirstRequest(steady_ttft_s, cold_ttft_s, steady_tpot_s, extra, launches, n, paths)
