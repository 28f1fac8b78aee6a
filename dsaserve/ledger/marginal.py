"""One decode step's cost per GPU, and the marginal cost per generated token against batch and context.

Owns: note 001's three ledgers — communication (collectives of the step), weight read (experts the step
touches + the replicated part), KV + indexer read (top-k main KV, every key of the indexer) — as step
times on one GPU's critical path, their per-token values (step term / tokens the step emits), the worked step
(batch 32, 128K) and the switch points where one ledger overtakes another. Request-path stages: 6 (decode), 7 (the
verify and draft forwards of speculative decoding, speculative.py).
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.common.causal import keys_within_topk
from dsaserve.config import ModelConfig
from dsaserve.ledger.collective_plan import (
    CollectiveRow,
    a2a_tokens,
    forward_layers,
    hidden_reduction_rows,
    row_time,
    step_plan,
)
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.hardware import Hardware
from dsaserve.ledger.kv import kv_per_token, kv_share_per_gpu
from dsaserve.ledger.speculative import Forward, acceptance, drafts, expected_tokens, step_forwards
from dsaserve.ledger.units import ceil_div
from dsaserve.ledger.weights import WeightInventory, experts_touched_fraction, step_read_per_gpu


@dataclass(frozen=True)
class Term:
    key: str
    name: str
    bytes: float  # per GPU (wire bytes for collectives)
    calls: int
    time_s: float
    why: str


@dataclass(frozen=True)
class DecodeStep:
    batch: int
    context: int
    requests_per_gpu: int
    experts_touched: float
    terms: tuple[Term, ...]
    tokens_per_request: float = 1.0  # expected tokens a request emits a step (> 1 with speculation: speculative.py)
    drafts: int = 0

    def term(self, key: str) -> Term:
        return next(t for t in self.terms if t.key == key)

    @property
    def serial_s(self) -> float:
        """Sum of the terms (the notes' share column divides by this)."""
        return sum(t.time_s for t in self.terms)

    @property
    def overlapped_s(self) -> float:
        """Lower bound: HBM terms add (one memory system), collectives overlap them."""
        hbm = sum(t.time_s for t in self.terms if t.key in ("weights", "kv", "indexer"))
        comm = sum(t.time_s for t in self.terms if t.key not in ("weights", "kv", "indexer"))
        return max(hbm, comm)

    def ledger(self, name: str) -> float:
        """Step seconds of one of the three ledgers: 'comm', 'weights', 'kv' (main KV + indexer)."""
        keys = {"comm": ("reductions", "moe_a2a", "lm_gather"), "weights": ("weights",), "kv": ("kv", "indexer")}
        return sum(t.time_s for t in self.terms if t.key in keys[name])


def _rows_term(key: str, name: str, rows: list[CollectiveRow], hw: Hardware, asm: Assumptions, why: str) -> Term:
    wire = sum(r.wire_bytes if asm.comm_basis == "wire" else r.total_message for r in rows)
    return Term(key, name, wire, sum(r.calls for r in rows), sum(row_time(r, hw, asm) for r in rows), why)


def _a2a_why(cfg: ModelConfig, dep: Deployment, asm: Assumptions, batch: int, rows: list[CollectiveRow],
             k: int = 0) -> str:
    if not rows:
        return "no EP: none"
    tokens = batch * (k + 1)
    sent, n = a2a_tokens(dep, asm, tokens), dep.ep
    verify = f" ({k + 1} a request: the verify; the MTP forwards alike)" if k else ""
    per = (f"top-{cfg.num_experts_per_tok} x hidden x ({asm.dispatch_bytes} + {asm.combine_bytes}) B per MoE "
           "layer")
    if asm.a2a_count == "deployment":
        return f"all {tokens:,} tokens{verify}, every sender summed (a2a_count=deployment) x {per}"
    return f"this rank's {sent:,} of {tokens:,} tokens{verify} x {per}; {n - 1}/{n} of the copies leave the GPU"


def decode_step(cfg: ModelConfig, inv: WeightInventory, dep: Deployment, hw: Hardware, asm: Assumptions,
                kv_layout: str, batch: int, context: int) -> DecodeStep:
    """One decode step of `batch` requests at `context` keys each: its forwards' terms summed (speculative.py: with
    speculation on, the verify over 1 + k tokens a request and the MTP layer's k draft forwards)."""
    k = drafts(asm)
    fwds = step_forwards(batch, k, acceptance(asm))
    plan = [r for f in fwds for r in step_plan(cfg, dep, asm, f.tokens, logits_rows=f.logits_rows, mtp=_mtp(f))]
    per_tok = kv_per_token(cfg, kv_layout, asm)
    share = kv_share_per_gpu(dep, asm)
    req_gpu = ceil_div(batch, dep.dp) if dep.dp_attention else batch
    selected = min(cfg.index_topk, context)
    every_key = keys_within_topk(context, asm.page_size, cfg.index_topk)
    kv_bytes = share * req_gpu * per_tok.main_per_layer * sum(
        _kv_rows(f, selected, asm) * forward_layers(cfg, _mtp(f))[0] for f in fwds)
    idx_bytes = 0 if every_key else share * req_gpu * context * per_tok.indexer_per_layer * sum(
        _indexer_layers(cfg, f) * f.key_reads for f in fwds)
    w = sum(decode_weight_read(cfg, inv, dep, asm, batch, context).values())
    red = hidden_reduction_rows(plan)
    a2a = [r for r in plan if r.kind == "all_to_all"]
    gather = [r for r in plan if r.point.startswith("vocab")]
    spec = f"; {k} drafts a request: verify + {k} MTP forwards" if k else ""
    terms = (
        _rows_term("reductions", "hidden-size reductions", red, hw, asm,
                   "embedding / per-layer all-reduce or DP gather + reduce-scatter, at b x hidden x 2 B" + spec),
        _rows_term("moe_a2a", "MoE dispatch + combine", a2a, hw, asm, _a2a_why(cfg, dep, asm, batch, a2a, k)),
        Term("kv", "main KV read", kv_bytes, 0, kv_bytes / hw.hbm_bw,
             f"{req_gpu} requests/GPU x top-{selected} slots x {per_tok.main_per_layer} B x "
             f"{cfg.num_hidden_layers} layers" + (" / TP (layer split)" if share < 1 else "")
             + (f"; verify: {k + 1} queries a request ({asm.prefill_kv_gather}), MTP layer: {len(fwds) - 1} "
                "forwards" if k else "")),
        Term("indexer", "indexer K read", idx_bytes, 0, idx_bytes / hw.hbm_bw,
             f"none: {context:,} keys are within the top-{cfg.index_topk}, every one is taken unscored" if every_key
             else f"{req_gpu} requests/GPU x {context:,} keys x {per_tok.indexer_per_layer} B x "
             f"{len(cfg.full_indexer_layers)} full layers" + (f", each of the verify's {k + 1} rows a request (decode "
                                                              f"rows), + the MTP layer's in each of its {k} forwards"
                                                              if k else "")),
        Term("weights", "weight read", w, 0, w / hw.hbm_bw,
             "replicated part + this GPU's experts touched by the step's tokens"
             + (" (within the top-k: no indexer query projections)" if every_key else "")
             + (f"; the MTP layer and the lm_head once a draft forward ({k})" if k else "")),
        _rows_term("lm_gather", "LM-head logits gather", gather, hw, asm,
                   "b x vocab x 4 B, ring all-gather" + (f", at each of the verify's {k + 1} rows a request and "
                                                         "each draft forward" if k else "")),
    )
    frac = experts_touched_fraction(cfg, fwds[0].tokens, asm.expert_routing)
    return DecodeStep(batch, context, req_gpu, frac, terms, expected_tokens(k, acceptance(asm)), k)


def _mtp(f: Forward) -> str | bool:
    return "only" if f.part == "mtp" else False


def _kv_rows(f: Forward, selected: int, asm: Assumptions) -> float:
    """Main-KV rows a request's queries of one forward gather a layer: its top-k, once a query ('slots'), or once a
    row ('rows': consecutive queries select nearly the same rows, each new position adds one)."""
    if f.queries == 1 or asm.prefill_kv_gather == "slots":
        return f.queries * selected
    return selected + f.queries - 1


def _indexer_layers(cfg: ModelConfig, f: Forward) -> int:
    return forward_layers(cfg, _mtp(f))[0] if f.part == "mtp" else len(cfg.full_indexer_layers)


def decode_weight_read(cfg: ModelConfig, inv: WeightInventory, dep: Deployment, asm: Assumptions, batch: int,
                       context: int) -> dict[str, float]:
    """One GPU's weight bytes by group that a decode step of `batch` requests reads over its forwards: the main
    model's groups in the verify (or the plain step), the MTP layer's and the shared lm_head in each draft forward."""
    out: dict[str, float] = {}
    for f in step_forwards(batch, drafts(asm), acceptance(asm)):
        for g, b in step_read_per_gpu(cfg, inv, dep, asm, f.tokens, context=context).items():
            if (g.startswith("mtp.") or g == "lm_head") if f.part == "mtp" else not g.startswith("mtp."):
                out[g] = out.get(g, 0.0) + b
    return out


@dataclass(frozen=True)
class MarginalPoint:
    batch: int
    context: int
    comm_s: float  # per generated token
    weights_s: float
    kv_s: float
    step_s: float  # serial step time


def marginal(step: DecodeStep) -> MarginalPoint:
    b = step.batch * step.tokens_per_request  # tokens the step emits
    return MarginalPoint(step.batch, step.context, step.ledger("comm") / b, step.ledger("weights") / b,
                         step.ledger("kv") / b, step.serial_s)


def sweep_batch(fn, batches: list[int], context: int) -> list[MarginalPoint]:
    return [marginal(fn(b, context)) for b in batches]


def sweep_context(fn, contexts: list[int], batch: int) -> list[MarginalPoint]:
    return [marginal(fn(batch, c)) for c in contexts]


@dataclass(frozen=True)
class SwitchPoint:
    name: str
    value: int | None  # batch or context where the second ledger overtakes the first; None = not in range
    unit: str  # "batch" or "tokens"
    why: str


def _first(pred, lo: int, hi: int) -> int | None:
    """Smallest x in [lo, hi] with pred(x) true, assuming pred is monotone (False ... True)."""
    if not pred(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def switch_points(fn, batch: int, context: int, max_batch: int = 8192, max_context: int = 1 << 24
                  ) -> list[SwitchPoint]:
    """Where the three ledgers cross (per generated token)."""
    def m(b: int, c: int) -> MarginalPoint:
        return marginal(fn(b, c))

    b_wc = _first(lambda b: m(b, context).weights_s <= m(b, context).comm_s, 1, max_batch)
    c_kw = _first(lambda c: m(batch, c).kv_s >= m(batch, c).weights_s, 1, max_context)
    c_kc = _first(lambda c: m(batch, c).kv_s >= m(batch, c).comm_s, 1, max_context)
    return [
        SwitchPoint("weight read -> communication", b_wc, "batch",
                    f"at context {context:,}: from this batch on, weights per token cost less than the step's "
                    "collectives per token (continuous batching stops paying)"),
        SwitchPoint("weight read -> KV + indexer read", c_kw, "tokens",
                    f"at batch {batch}: from this context on, KV + indexer read per token exceeds the amortised "
                    "weight read"),
        SwitchPoint("communication -> KV + indexer read", c_kc, "tokens",
                    f"at batch {batch}: from this context on, KV + indexer read per token exceeds communication"),
    ]
