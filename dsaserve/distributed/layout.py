"""Layout check: whether a TP / EP / DP-attention layout splits a model exactly (startup chain, before "load
weights"). Pure arithmetic over ModelConfig: no torch, no process group, so `EngineArgs.check_layout` can
refuse a bad layout before any rank is spawned or any tensor read.

Owns: the messages that name the config field, its value, the flag and the rank count.
"""

from __future__ import annotations

from dsaserve.config import FP8_BLOCK, ModelConfig


def check_layout(cfg: ModelConfig, tp: int, ep: int, dp_attention: bool = False, keep_fp8: bool = False) -> None:
    """ValueError for the first split that is not exact (heads, vocab, widths by tp; experts by ep; with
    FP8 weights kept for the GPU kernels, every rank's part a whole number of 128-blocks)."""
    world = max(tp, ep)
    moe_tp = world // ep
    attn_tp = 1 if dp_attention else tp
    checks = [("num_attention_heads", cfg.num_attention_heads, attn_tp, "--tensor-parallel-size"),
              ("intermediate_size", cfg.intermediate_size, attn_tp, "--tensor-parallel-size"),
              ("vocab_size", cfg.vocab_size, attn_tp, "--tensor-parallel-size"),
              ("moe_intermediate_size * n_shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts,
               attn_tp, "--tensor-parallel-size"),
              ("n_routed_experts", cfg.n_routed_experts, ep, "--expert-parallel-size"),
              ("moe_intermediate_size", cfg.moe_intermediate_size, moe_tp, "world size / --expert-parallel-size")]
    for field_name, value, parts, flag in checks:
        if parts > 1 and value % parts:
            raise ValueError(f"{flag} = {parts}: {field_name} = {value} is not divisible by {parts}")
    if not keep_fp8:
        return
    blocks = [("moe_intermediate_size", cfg.moe_intermediate_size, moe_tp),
              ("intermediate_size", cfg.intermediate_size, attn_tp),
              ("num_attention_heads * v_head_dim (o_proj columns)", cfg.num_attention_heads * cfg.v_head_dim,
               attn_tp)]
    for field_name, value, parts in blocks:
        if parts > 1 and (value // parts) % FP8_BLOCK:
            raise ValueError(f"{parts} ranks leave {value // parts} of {field_name} = {value} per rank, not a "
                             f"multiple of the FP8 block {FP8_BLOCK}: keeping FP8 weights needs whole blocks")
