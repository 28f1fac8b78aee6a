"""Deployment, workload and assumptions: every input of a ledger report that is not the model or the GPU.

Owns: `Deployment` (TP / EP / DP-attention / PD / GPU count, and which weights each rank therefore
holds), `Workload` (KV layout, context, batch, chunk), and `Assumptions` — every modelling choice the
notes make silently, as a named parameter with a default and a one-line reason (`--assume key=value`
sets any of them). Validation errors name the flag. Planning tool, no stage of the request path.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT, get_kv_layout
from dsaserve.config import ModelConfig
from dsaserve.distributed.layout import Layout, check_divisions
from dsaserve.ledger.units import K_TOKENS, M_TOKENS


@dataclass(frozen=True)
class Deployment:
    tp: int = 8
    ep: int = 1
    dp_attention: bool = False
    pd: bool = False
    n_gpus: int = 0  # 0 = max(tp, ep): one model replica

    def __post_init__(self) -> None:
        for name in ("tp", "ep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name}: must be a positive integer, got {v!r}")
        if isinstance(self.n_gpus, bool) or not isinstance(self.n_gpus, int) or self.n_gpus < 0:
            raise ValueError(f"--gpus: must be a non-negative integer, got {self.n_gpus!r}")
        if self.n_gpus == 0:
            object.__setattr__(self, "n_gpus", max(self.tp, self.ep))
        if self.n_gpus < max(self.tp, self.ep):
            raise ValueError(f"--gpus: {self.n_gpus} is fewer than --tp {self.tp} / --ep {self.ep} need")

    def validate_for(self, cfg: ModelConfig) -> None:
        """Every split exact, by the engine's own rule (what `dsaserve serve` checks); the ledger also plans layouts
        the engine does not run (e.g. --tp 4 --ep 8), so its size rules and FP8 128-block alignment are not applied."""
        check_divisions(cfg, Layout(self.tp, self.ep, self.dp_attention))

    def warnings(self) -> list[dict[str, object]]:
        """GPUs past the last whole replica: the decode sections count whole replicas (kv.py), so these hold no
        requests there, while the prefill sections split a prompt over every GPU (the report's `warnings`)."""
        replica = max(self.tp, self.ep)
        idle = self.n_gpus % replica
        if not idle:
            return []
        return [{"code": "gpus_past_whole_replicas", "idle_gpus": idle,
                 "message": f"--gpus {self.n_gpus} is not a multiple of a replica's {replica} GPUs (--tp {self.tp} / "
                            f"--ep {self.ep}): {idle} GPUs hold no decode requests ({self.n_gpus // replica} "
                            f"replicas), though the prefill sections split prompts over all {self.n_gpus}"}]

    @property
    def dp(self) -> int:
        """DP-attention ranks (SGLang: --dp-size = --tp): each holds and attends its own requests."""
        return self.tp if self.dp_attention else 1

    @property
    def attn_tp(self) -> int:
        return 1 if self.dp_attention else self.tp

    @property
    def topology(self) -> str:
        if self.dp_attention:
            base = f"DP-attention{self.tp}" + (f"+EP{self.ep}" if self.ep > 1 else f"+TP{self.tp} MLP")
        else:
            base = f"TP{self.tp}" + (f"+EP{self.ep}" if self.ep > 1 else "")
        return base + (" (PD-disaggregated)" if self.pd else "") + f", {self.n_gpus} GPUs"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"topology": self.topology}


@dataclass(frozen=True)
class Workload:
    kv_layout: str = DEFAULT_KV_LAYOUT  # a name of common/kv_layout.py's KV_LAYOUTS (planning layouts too)
    context: int = M_TOKENS  # the long request: KV capacity, PD transfer, chunked prefill
    batch: int = 32  # decode requests per step, whole deployment (worked step)
    decode_context: int = 128 * K_TOKENS  # context of each request in the worked decode step
    chunk: int = 32768  # chunked_prefill_size (SGLang's 32K chunk in note 001)
    prefix_hit: int = 19_000  # prompt tokens already in the prefix cache (note 001's 19K-of-20K example)
    prompt: int = 20_000

    def __post_init__(self) -> None:
        get_kv_layout(self.kv_layout, "--kv-layout", engine=False)
        for name in ("context", "batch", "decode_context", "chunk", "prompt"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be a positive integer, got {v!r}")
        if not 0 <= self.prefix_hit <= self.prompt:
            raise ValueError(f"--prefix-hit: {self.prefix_hit} must be between 0 and --prompt {self.prompt}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _a(default: Any, why: str, choices: tuple[Any, ...] | None = None) -> Any:
    return field(default=default, metadata={"why": why, "choices": choices})


@dataclass(frozen=True)
class Assumptions:
    mla_kv: str = _a("replicated", "pure TP: every rank holds the whole MLA latent (SGLang) or 1/TP of the layers "
                     "(the notes' 'split')", ("replicated", "split"))
    indexer_q_tile: int = _a(32, "prefill indexer: queries that share one read of a key block; the notes' "
                             "~47 TB for 1M implies ~32 (1 = every query re-reads every key)")
    mem_fraction_static: float = _a(0.85, "share of HBM for weights + KV pool (note 000: 0.85)")
    reserved_bytes: float = _a(0.0, "other static bytes inside that share per GPU (CUDA context, NCCL/DeepEP "
                               "buffers)")
    comm_basis: str = _a("wire", "'wire': per-rank ring bytes / per-direction link bandwidth; 'message': message "
                         "bytes / an effective bandwidth (the notes' 787 GB/s method)", ("wire", "message"))
    expert_routing: str = _a("uniform", "experts a step touches: expected under uniform top-k routing, or 'all' "
                             "(the notes' large-batch assumption)", ("uniform", "all"))
    moe_dense_tp_size: int = _a(0, "TP size of dense-layer MLPs and shared experts (0 = --tp, SGLang's default; "
                                "1 = replicated, the notes' '18 GB replicated part')")
    dp_gather: str = _a("once", "DP-attention: hidden all-gather once per step (note's table) or per layer "
                        "(note's worked example, 156 calls)", ("once", "per_layer"))
    dp_moe: str = _a("gather", "DP-attention MLP side: 'gather' = the notes' table (hidden all-gather, per-layer "
                     "reduce-scatter, dense MLPs / shared experts / lm_head TP-split); dsaserve's engine (all but the "
                     "routed experts replicated) as 'padded' = its graph-safe decode path (every rank padded to one "
                     "row count; per MoE layer an all-gather of the hidden rows and a reduce-scatter of the routed "
                     "sums) or 'a2a' = its all-to-all path (per MoE layer a count all-to-all, dispatch, combine)",
                     ("gather", "padded", "a2a"))
    dp_embed_allreduce: bool = _a(False, "DP-attention: embedding still vocab-parallel (one more all-reduce, the "
                                  "note's '1+1+78+3')")
    a2a_count: str = _a("rank", "MoE dispatch / combine bytes: 'rank' = one rank's own tokens (ceil(b/dp) under "
                        "DP-attention, ceil(b/ep) scattered over the EP group otherwise), what it puts on its "
                        "link; 'deployment' = all b tokens' copies, every sender summed (the notes' b x 8 x 6144)",
                        ("rank", "deployment"))
    act_bytes: int = _a(2, "BF16 hidden states on the wire")
    dispatch_bytes: int = _a(1, "FP8 tokens in MoE dispatch (DeepEP)")
    combine_bytes: int = _a(2, "BF16 expert outputs in MoE combine")
    logits_bytes: int = _a(4, "FP32 logits in the vocab all-gather")
    speculative: bool = _a(False, "MTP on: the MTP layer is loaded and has KV, and every decode step verifies drafts")
    speculative_num_steps: int = _a(1, "with speculative on: drafts a request a decode step verifies "
                                    "(--speculative-num-steps, 1-8): the main model computes 1 + k tokens a request, "
                                    "the MTP layer runs k forwards (engine/mtp.py)")
    draft_acceptance: float = _a(0.8, "with speculative on: chance a draft is kept when the drafts before it were, one "
                                 "rate at every position (DeepSeek-V3's report: 85-90 % of second tokens accepted; "
                                 "the built-in mini's MTP layer keeps 0.68 at one draft, bench_speculative.py)")
    draft_acceptance_by_position: str = _a("", "with speculative on: that chance at positions 1, 2, ... "
                                           "(comma-separated, the last repeats; bench_speculative.py prints a run's), "
                                           "in place of draft_acceptance (empty: draft_acceptance everywhere)")
    nvfp4_rope: str = _a("fp8", "nvfp4_ds_mla rope part: FP8 (352 B/token/layer, the notes' figure) or BF16 (416)",
                         ("fp8", "bf16"))
    page_size: int = _a(64, "tokens per KV page (SGLang / dsaserve)")
    page_id_bytes: int = _a(4, "int32 page ids in the block table")
    compute_efficiency: float = _a(1.0, "fraction of dense peak FLOP/s; 1.0 makes times lower bounds")
    indexer_split: bool = _a(True, "prefill indexer work and reads spread evenly over all GPUs (the notes); "
                             "False = every TP rank scores every query")
    prefill_staging: bool = _a(True, "prefill steps the engine's rule stages (common/causal.py: >= 512 tokens, <= 8 "
                               "context rows a token, fp8_ds_mla at kv_lora 512) dequantise their pages once a layer "
                               "to bf16 and sparse MLA gathers bf16 rows (GPU kernels); False = "
                               "DSASERVE_PREFILL_STAGING=0, sparse MLA reads the cache")
    prefill_kv_gather: str = _a("rows", "prefill sparse MLA's top-k gather in the HBM time: 'rows' = each context row "
                                "once a layer (a chunk's queries share most of their rows, L2 serves the repeats); "
                                "'slots' = every selected slot from HBM (what kv_bytes_read counts, an upper "
                                "estimate)", ("rows", "slots"))
    kernels_per_op: float = _a(1.0, "GPU kernels per operator of the operator list")
    absorbed_heads: str = _a("checkpoint", "kv_b as decode holds and reads it (W_uk / W_uv): at the checkpoint's FP8 "
                             "bytes + scales (the notes), or 'bf16': dsaserve's GPU path, which keeps the absorbed "
                             "heads in bf16 (2 B a value, no scales: ~2x; the engine's byte counters and --reconcile "
                             "keep the checkpoint's bytes)", ("checkpoint", "bf16"))
    launch_overhead_s: float = _a(4e-6, "one eager kernel launch (note 000/001: 3-5 us)")
    cuda_graph_max_bs: int = _a(256, "largest captured decode batch; bigger batches run eager")
    first_request_tokens: int = _a(100, "tokens the first request generates")
    compile_s_per_shape: float = _a(1.0, "first-time Triton compile / autotune of one new shape (note 000: tens "
                                    "of ms to seconds)")
    uncovered_prefill_shapes: int = _a(0, "prefill shapes of the first request that warmup did not run")
    grammar_compile_s: float = _a(0.0, "first use of a JSON schema: grammar compile")

    @property
    def engine_dp(self) -> bool:
        """DP-attention as dsaserve's engine runs it: everything but the routed experts whole on every rank."""
        return self.dp_moe in ("padded", "a2a")

    def with_updates(self, updates: dict[str, str | Any], via_flags: bool = False) -> Assumptions:
        """Set fields from strings (`--assume key=value`; `via_flags`: from their own flags, ASSUMPTION_FLAGS);
        errors name the key (or the flag), the value as given and the allowed values."""
        known = {f.name: f for f in fields(self)}
        out: dict[str, Any] = {}
        for key, raw in updates.items():
            f = known.get(key)
            if f is None:
                raise ValueError(f"--assume {key}: unknown assumption (one of {', '.join(known)})")
            label = ASSUMPTION_FLAGS[key] if via_flags else f"--assume {key}"
            out[key] = _coerce(label, type(f.default), raw, f.metadata.get("choices"))
            problem = _problem(key, out[key])
            if problem:
                raise ValueError(f"{label}: {problem}, got {raw}")
        return replace(self, **out)

    def __post_init__(self) -> None:
        for f in fields(self):
            v, choices = getattr(self, f.name), f.metadata.get("choices")
            label = ASSUMPTION_FLAGS.get(f.name, f"--assume {f.name}")
            if choices and v not in choices:
                raise ValueError(f"{label}: {v!r} not one of {', '.join(map(str, choices))}")
            problem = _problem(f.name, v)
            if problem:
                raise ValueError(f"{label}: {problem}, got {v}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def describe() -> dict[str, str]:
        return {f.name: f.metadata["why"] for f in fields(Assumptions)}


# assumptions with a flag of their own (cli/ledger.py): the flag names them, unless set through --assume
ASSUMPTION_FLAGS = {"mem_fraction_static": "--mem-fraction-static", "indexer_q_tile": "--indexer-q-tile",
                    "mla_kv": "--mla-kv", "speculative_num_steps": "--speculative-num-steps",
                    "draft_acceptance": "--draft-acceptance", "draft_acceptance_by_position": "--draft-acceptance"}
MAX_DRAFTS = 8  # engine/engine_args.MAX_SPECULATIVE_STEPS (the ledger imports no engine code; a test ties the two)


def _problem(name: str, v: Any) -> str | None:
    """What is wrong with an assumption's value beyond its type and choices (None: nothing)."""
    if name in ("mem_fraction_static", "compute_efficiency") and not 0 < v <= 1:
        return "must be in (0, 1]"
    if name in ("indexer_q_tile", "page_size") and v < 1:
        return "must be >= 1"
    if name == "speculative_num_steps" and not 1 <= v <= MAX_DRAFTS:
        return f"must be in [1, {MAX_DRAFTS}] (the engine's --speculative-num-steps)"
    if name == "draft_acceptance" and not 0 <= v <= 1:
        return "must be in [0, 1]"
    if name == "draft_acceptance_by_position" and v:
        try:
            rates = [float(x) for x in v.split(",")]
        except ValueError:
            return "must be comma-separated numbers"
        if not all(0 <= r <= 1 for r in rates):
            return "every rate must be in [0, 1]"
    return None


def _coerce(label: str, typ: type, raw: Any, choices: tuple[Any, ...] | None) -> Any:
    if not isinstance(raw, str):
        return raw
    try:
        if typ is bool:
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return raw.lower() in ("1", "true", "yes", "on")
        if typ is int:
            return int(raw)
        if typ is float:
            return float(raw)
    except ValueError:
        raise ValueError(f"{label}: {raw!r} is not a {typ.__name__}") from None
    if choices and raw not in choices:
        raise ValueError(f"{label}: {raw!r} not one of {', '.join(map(str, choices))}")
    return raw
