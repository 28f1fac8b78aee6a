"""Rotary position embedding tables: per-token cos/sin of the `qk_rope_head_dim` slice.

Owns: the inverse frequencies for `default` and `yarn` RoPE (DeepSeek-V3.2) exactly as HF computes them,
and the YaRN softmax-scale correction (mscale^2) MLA applies. Shared by MLA and the indexer.
"""

from __future__ import annotations

import math

import torch

from dsaserve.config import ModelConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    rp, dim = cfg.rope_parameters, cfg.qk_rope_head_dim
    base = float(rp["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rp["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor, orig = float(rp["factor"]), int(rp["original_max_position_embeddings"])
    mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
    attn = rp.get("attention_factor")
    if attn is None:
        attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else _yarn_mscale(factor)
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn)


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (HF yarn_apply_mscale)."""
    scale = cfg.qk_head_dim ** -0.5
    rp = cfg.rope_parameters
    if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
        m = _yarn_mscale(float(rp["factor"]), float(rp["mscale_all_dim"]))
        scale *= m * m
    return scale


class RotaryTables:
    """cos/sin [T, rope/2] for arbitrary positions (one angle per rotated pair).

    On a GPU the values for every position up to max_position_embeddings are computed once (a few tens of
    MB), cos and sin side by side in one row, and a step gathers its rows: one launch instead of the ~8
    elementwise kernels of computing them per step (two when cos and sin were apart: ~2.5 µs of a batch-1
    step each). cos / sin are the two halves of the gathered rows (views: unit last stride, row stride R,
    as every kernel that takes them reads them). The table holds exactly what the per-step formula gives
    (same fp32 products, same rounding).
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        inv, self.attention_factor = inv_freq_and_attention_factor(cfg)
        self.inv_freq = inv.to(device)
        self.max_positions = cfg.max_position_embeddings
        self.tables: dict[torch.dtype, torch.Tensor] = {}  # [positions, R]: cos | sin

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type == "cpu":  # the reference path computes what it needs
            return self._compute(positions, dtype)
        return self.table_rows(positions, dtype)

    def table_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The GPU path: rows of the table (built at the first, eager, forward: before any graph capture).
        Positions must be below max_position_embeddings (the engine caps max_model_len there)."""
        return self.halves(self.table(positions.device, dtype).index_select(0, positions))

    def table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """[max_positions, R] cos | sin for every position (made once a dtype, at the first, eager, forward)."""
        if dtype not in self.tables:
            cos, sin = self._compute(torch.arange(self.max_positions, device=device), dtype)
            self.tables[dtype] = torch.cat([cos, sin], dim=1)
        return self.tables[dtype]

    @staticmethod
    def halves(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered table rows [T, R] -> (cos, sin), views."""
        return rows.split(rows.shape[1] // 2, dim=1)
