"""MLPs: the dense SwiGLU MLP of the first layers and the routed MoE (stage 6, "MoE").

Owns: the router (sigmoid scores; `e_score_correction_bias` steers selection only; group-limited top-k;
normalised weights x routed_scaling_factor), the stacked expert weights (w13 = [gate; up] per expert, w2 =
down) that per-expert checkpoint tensors are loaded into, and the shared expert added to the routed sum.
Under TP / EP a rank holds its experts (and rows) only, and the layer ends with one reduction over the MoE
group, or all-to-all dispatch / combine (dsaserve/distributed/expert_parallel.py, docs/PARALLELISM.md).
Under DP-attention each rank holds its own tokens: a gather step (`batch.dp_rows`, every rank the same row
count) gathers every rank's rows (`dp_gather_forward`, graph-safe); otherwise each rank routes its own and
exchanges them (`dp_exchange`). `forward_idle` is either with no tokens, so a rank without work still makes
every call.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.common.counters import COUNTERS
from dsaserve.config import ModelConfig, is_not_converted
from dsaserve.distributed.collectives import all_reduce
from dsaserve.distributed.expert_parallel import (
    a2a_moe_forward,
    dp_exchange,
    dp_gather_forward,
    finalize_deferred_experts,
    idle_exchange,
    local_routes,
)
from dsaserve.distributed.parallel_state import get_parallel_state
from dsaserve.distributed.sharding import ExpertPlacement, Shard, fp8_misaligned, mark_sharded
from dsaserve.kernels.reference import SharedExpert, dequant_fp8_weight
from dsaserve.kernels.registry import get_ops
from dsaserve.model.layers.context import StepContext
from dsaserve.model.layers.linear import MergedLinear
from dsaserve.model.layers.parallel_linear import column_parallel, row_parallel
from dsaserve.weights.spec import scale_shape


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, inter: int, reduce_results: bool = True):
        super().__init__()
        q = lambda name: not is_not_converted(cfg, f"{prefix}.{name}")  # noqa: E731
        # TP: gate/up column-parallel, down row-parallel (+ all-reduce unless the MoE layer reduces once)
        self.gate_proj = column_parallel(cfg.hidden_size, inter, q("gate_proj"), f"{prefix}.gate_proj")
        self.up_proj = column_parallel(cfg.hidden_size, inter, q("up_proj"), f"{prefix}.up_proj")
        self.down_proj = row_parallel(inter, cfg.hidden_size, q("down_proj"), f"{prefix}.down_proj", reduce_results)

        self.gate_up: MergedLinear | None = None  # GPU path: gate + up as one GEMM (merge_projections)
        # GPU path, no TP reduction of its own: this MLP laid out as one routed expert, for `fused_moe` to run as
        # one more expert (a shared expert's; made once, by merge_projections)
        self.expert_form: SharedExpert | None = None

    def merge_projections(self) -> None:
        if MergedLinear.mergeable([self.gate_proj, self.up_proj]) and self.gate_proj.out_features % 128 == 0:
            self.gate_up = MergedLinear([self.gate_proj, self.up_proj])  # [gate | up]: no padding between
            self.gate_proj = self.up_proj = None
            down = self.down_proj
            if down.keep_fp8 and down.reduce_group is None:
                self.expert_form = SharedExpert(self.gate_up.weight, self.gate_up.weight_scale_inv, down.weight,
                                                down.weight_scale_inv, self.forward)

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down_proj(get_ops(x.device).silu_and_mul(self.gate_up.full_output(x)))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.bfloat16),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)
        # widened once after loading, not every step: E x H x 4 B more memory (6.3 MB per GLM-5.3 MoE layer,
        # 0.47 GB for its 75) against two launches and a 6 MB conversion per layer and step
        self.weight_f32: torch.Tensor | None = None

    def finalize(self, dtype: torch.dtype) -> None:
        self.weight_f32 = self.weight.data.float()

    def forward(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        w = self.weight_f32 if self.weight_f32 is not None else self.weight.float()  # HF routes in fp32
        logits = ctx.ops.router_logits(x, w)
        return ctx.ops.moe_route(logits, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                                 c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)


COUNT_BESIDE = True  # the experts-touched count on the side stream where a step has one (False: A/B, bisecting)
COUNT_ON_DEVICE = True  # False (bench A/B only, `profile_decode --ab count_off`): no GPU count, to time what it costs


class Experts(nn.Module):
    """E routed experts stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]. Under EP / MoE-TP,
    E and I are this rank's (`placement`); the loader skips other ranks' experts."""

    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        self.quantized = not is_not_converted(cfg, f"{prefix}.0.gate_proj")
        self.placement = p = ExpertPlacement.build(cfg, get_parallel_state(), self.quantized)
        e, h, i = p.count, cfg.hidden_size, p.param_inter
        dt = torch.float8_e4m3fn if self.quantized else torch.bfloat16
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dt), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dt), requires_grad=False)
        if self.quantized:
            self.w13_scale = nn.Parameter(torch.empty(e, *scale_shape((2 * i, h)), dtype=torch.float32),
                                          requires_grad=False)
            self.w2_scale = nn.Parameter(torch.empty(e, *scale_shape((h, i)), dtype=torch.float32),
                                         requires_grad=False)
        else:
            self.w13_scale = self.w2_scale = None
        per_param = 1 if self.quantized else 2
        self.expert_bytes = 3 * h * i * per_param + (
            (self.w13_scale[0].numel() + self.w2_scale[0].numel()) * 4 if self.quantized else 0)
        self.keep_fp8 = False
        self.touched: torch.Tensor | None = None  # device-side count of distinct experts read (GPU path)
        self.fp8_misaligned = fp8_misaligned(prefix, p.inter_shard, (p.inter, h)) if p.deferred else ""
        if p.inter_shard is not None and not p.deferred:  # checkpoint gate/up [I, H] split by row, down by column
            mark_sharded(p.inter_shard, self.w13, self.w13_scale)
            mark_sharded(Shard(1, p.inter_shard.rank, p.inter_shard.parts), self.w2, self.w2_scale)
        if p.deferred:
            self.expert_bytes //= p.inter_shard.parts  # bytes of the part this rank reads once sliced

    def finalize(self, dtype: torch.dtype, keep_fp8: bool) -> None:
        if self.placement.deferred:
            return finalize_deferred_experts(self, dtype, keep_fp8 and self.quantized)
        self.keep_fp8 = keep_fp8 and self.quantized
        if self.keep_fp8:
            return
        if self.quantized:
            self.w13 = nn.Parameter(dequant_fp8_weight(self.w13.data, self.w13_scale.data, dtype), requires_grad=False)
            self.w2 = nn.Parameter(dequant_fp8_weight(self.w2.data, self.w2_scale.data, dtype), requires_grad=False)
            self.w13_scale = self.w2_scale = None
        else:
            self.w13 = nn.Parameter(self.w13.data.to(dtype), requires_grad=False)
            self.w2 = nn.Parameter(self.w2.data.to(dtype), requires_grad=False)

    def _count_touched(self, ids: torch.Tensor, ctx: StepContext) -> None:
        """Distinct routed experts read this forward (`moe_experts_touched`, and their bytes). On the CPU
        counted at once; on a GPU accumulated on the device (no sync, and it replays inside CUDA graphs)
        and folded into the counters when they are read (`DEVICE_EXPERT_COUNTERS`). With a side stream
        (decode sizes) the count runs there, off the chain of kernels the step waits for: in line it added
        2.7 us a MoE layer at batch 1 and 7 at batch 128 (bench/RESULTS.md, twenty-fourth session)."""
        if ids.device.type == "cpu":
            if COUNTERS.enabled:
                n = int(ids.unique().numel())
                COUNTERS.add("moe_experts_touched", n)
                COUNTERS.add("weight_bytes_read", n * self.expert_bytes)
            return
        if not COUNT_ON_DEVICE:
            return
        if self.touched is None:
            self.touched = torch.zeros((), dtype=torch.int64, device=ids.device)
            DEVICE_EXPERT_COUNTERS.append(self)
        side = getattr(ctx, "side_stream", None) if COUNT_BESIDE else None
        if side is None:
            get_ops(ids.device).count_distinct(ids, self.w13.shape[0], self.touched)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            get_ops(ids.device).count_distinct(ids, self.w13.shape[0], self.touched)
        ctx.side_reads.append(ids)  # its memory is not reused before the step joins the side stream

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx: StepContext,
                add: torch.Tensor | None = None, shared: SharedExpert | None = None) -> torch.Tensor:
        """The routed sum (+ add, summed in the same kernel on the GPU; or + the `shared` expert, which the GPU
        kernel runs as one more expert at decode sizes)."""
        weights, ids, local = local_routes(weights, ids, self.placement)  # global -> this rank's expert ids
        self._count_touched(ids if local is None else ids[local] if ids.device.type == "cpu" else ids, ctx)
        side = getattr(ctx, "side_stream", None)  # where an unfused shared expert overlaps the routed ones
        beside = {"side_stream": side} if shared is not None and side is not None else {}
        return ctx.ops.fused_moe(x, self.w13, self.w13_scale, self.w2, self.w2_scale, weights, ids, add=add,
                                 absent=local is not None, shared=shared, **beside)


DEVICE_EXPERT_COUNTERS: list[Experts] = []


def fold_device_expert_counts(reset: bool = False) -> dict[str, float]:
    """Read (and with reset=True, zero) the GPU experts' device counters: one sync, at snapshot time."""
    touched = bytes_ = 0.0
    for e in DEVICE_EXPERT_COUNTERS:
        n = int(e.touched.item())
        touched, bytes_ = touched + n, bytes_ + n * e.expert_bytes
        if reset:
            with torch.inference_mode():  # created inside the forward's inference mode
                e.touched.zero_()
    return {"moe_experts_touched": touched, "weight_bytes_read": bytes_}


COUNTERS.add_source(fold_device_expert_counts)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg, f"{prefix}.experts")
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = DenseMLP(cfg, f"{prefix}.shared_experts", inter, reduce_results=False) \
            if cfg.n_shared_experts else None
        state = get_parallel_state()  # EP / TP: one all-reduce sums routed parts (+ TP-split shared expert)
        self.group, self.shared_split, self.a2a = state.moe_group, state.tp_size > 1, state.moe_a2a
        self.dp = state.dp_attention and state.moe_group.size > 1

    def forward_idle(self, dtype: torch.dtype, device: torch.device, ctx, dp_rows: int = 0,
                     dp_tokens: tuple[int, ...] = ()) -> None:
        """DP-attention, no tokens on this rank: the layer's collectives (and its experts' work for others) —
        of a gather step when `dp_rows`, else of the exchange."""
        if not self.dp:
            return
        if dp_rows:
            dp_gather_forward(self, torch.empty(0, self.gate.cfg.hidden_size, dtype=dtype, device=device), dp_rows,
                              dp_tokens, ctx)
        else:
            idle_exchange(self.experts, self.group, self.gate.cfg.hidden_size, dtype, device, ctx)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if self.dp and ctx.batch.dp_rows:  # DP gather step: route every rank's rows, after the gather
            return dp_gather_forward(self, x, ctx.batch.dp_rows, ctx.batch.dp_tokens, ctx)
        weights, ids = self.gate(x, ctx)
        if self.dp:  # own tokens only: routed experts by exchange, the (replicated) shared expert here
            out = dp_exchange(self.experts, self.group, x, weights, ids, ctx)
            return out if self.shared_experts is None else out + self.shared_experts(x)
        if self.a2a:
            return a2a_moe_forward(self, x, weights, ids, ctx)
        if self.shared_experts is not None and self.group.size == 1:  # one device: the add rides the combine
            shared = self.shared_experts.expert_form
            if shared is not None:
                return self.experts(x, weights, ids, ctx, shared=shared)
            return self.experts(x, weights, ids, ctx, add=self.shared_experts(x))
        out = self.experts(x, weights, ids, ctx)
        if self.shared_experts is None:
            return all_reduce(out, self.group)
        if self.shared_split:
            return all_reduce(out + self.shared_experts(x), self.group)
        return all_reduce(out, self.group) + self.shared_experts(x)

