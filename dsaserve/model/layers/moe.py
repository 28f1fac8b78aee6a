"""MLPs: the dense SwiGLU MLP of the first layers and the routed MoE (stage 6, "MoE").

Owns: the router (sigmoid scores; `e_score_correction_bias` steers selection only; group-limited top-k;
normalised weights x routed_scaling_factor), the stacked expert weights (w13 = [gate; up] per expert, w2 =
down) that per-expert checkpoint tensors are loaded into, and the shared expert added to the routed sum.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.engine.counters import COUNTERS
from dsaserve.kernels.reference import dequant_fp8_weight
from dsaserve.model.layers.context import StepContext
from dsaserve.model.layers.linear import Linear
from dsaserve.weights.spec import is_not_converted, scale_shape


class DenseMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, inter: int):
        super().__init__()
        q = lambda name: not is_not_converted(cfg, f"{prefix}.{name}")  # noqa: E731
        self.gate_proj = Linear(cfg.hidden_size, inter, q("gate_proj"))
        self.up_proj = Linear(cfg.hidden_size, inter, q("up_proj"))
        self.down_proj = Linear(inter, cfg.hidden_size, q("down_proj"))

    def forward(self, x: torch.Tensor, ctx: StepContext | None = None) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.bfloat16),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        COUNTERS.add("weight_bytes_read", self.weight.numel() * 2 + self.e_score_correction_bias.numel() * 4)
        logits = x.float() @ self.weight.float().t()  # HF routes in fp32
        return ctx.ops.moe_route(logits, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                                 c.topk_group, c.routed_scaling_factor, c.norm_topk_prob)


class Experts(nn.Module):
    """E routed experts stacked: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]."""

    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.quantized = not is_not_converted(cfg, f"{prefix}.0.gate_proj")
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

    def finalize(self, dtype: torch.dtype, keep_fp8: bool) -> None:
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

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if COUNTERS.enabled and ids.device.type == "cpu":  # distinct routed experts; a device sync elsewhere
            COUNTERS.add("weight_bytes_read", int(ids.unique().numel()) * self.expert_bytes)
        return ctx.ops.fused_moe(x, self.w13, self.w13_scale, self.w2, self.w2_scale, weights, ids)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg, f"{prefix}.experts")
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = DenseMLP(cfg, f"{prefix}.shared_experts", inter) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        weights, ids = self.gate(x, ctx)
        out = self.experts(x, weights, ids, ctx)
        return out + self.shared_experts(x) if self.shared_experts is not None else out
