"""Layout validation: can this model be split this way? Answered before any process group or weight exists.

Owns: `check_layout(cfg, tp, ep, dp_attention, keep_fp8)` (raises ValueError naming the flag, the config
field and the numbers), the size rules of a layout (`check_sizes`), ranks against visible GPUs
(`check_gpu_count`), and the split arithmetic they use (`Layout`). Pure Python, no torch: EngineArgs-level
validation calls it with only a ModelConfig, and `parallel_state.validate_for_model` calls it again when the
model is built (startup chain: "spawn / init distributed" -> here -> "load weights").

Layouts (SGLang's, one model replica over world = max(tp, ep) ranks):
  TP        tp = world: attention heads, dense MLPs, shared experts and the vocab split tp ways.
  EP        ep | world: routed experts split ep ways; each expert's intermediate split world / ep ways.
  replicated attention + EP: tp = 1, ep = world.
  DP-attention (`dp_attention`, ep = world): every rank runs attention, dense MLPs, the shared expert,
            embedding and lm_head whole on its own batch; only routed experts are split (ep ways). `tp` may
            be given as 1 or as the world size (SGLang's `--tp N --enable-dp-attention`): attention TP is 1.
FP8 kernels (`keep_fp8`, the GPU path) need every rank's part of a quantised weight to be whole 128 x 128
scale blocks; the CPU reference path dequantises before slicing, so it only needs exact division.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.config import FP8_BLOCK, ModelConfig, is_not_converted


def _positive(flag: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{flag}: must be a positive integer, got {v!r}")
    return v


@dataclass(frozen=True)
class Layout:
    tp: int = 1  # as asked (under DP-attention: 1 or the world size)
    ep: int = 1
    dp_attention: bool = False

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def attn_tp(self) -> int:
        """Ways attention heads, dense MLPs, shared experts and the vocab are split (1 under DP-attention)."""
        return 1 if self.dp_attention else self.tp

    @property
    def moe_tp(self) -> int:
        """Ways each routed expert's intermediate dim is split."""
        return self.world // self.ep

    @property
    def flags(self) -> str:
        return f"--tp {self.tp} --ep {self.ep}" + (" --enable-dp-attention" if self.dp_attention else "")


def check_sizes(tp: int, ep: int, dp_attention: bool = False, flag_tp: str = "--tp", flag_ep: str = "--ep",
                moe_a2a: bool = False) -> Layout:
    """The layout rules that need no model: positive sizes, tp in {1, world}, ep | world; DP-attention over
    several ranks and, like all-to-all MoE, with ep = world. The one copy of these rules: EngineArgs (flag
    names) and `initialize_model_parallel` (argument names) both call it."""
    lay = Layout(_positive(flag_tp, tp), _positive(flag_ep, ep), bool(dp_attention))
    if tp not in (1, lay.world):
        raise ValueError(f"{flag_tp} {tp}: must be 1 or the world size {lay.world} = max(tp, ep) "
                         "(one model replica)")
    if lay.world % ep:
        raise ValueError(f"{flag_ep} {ep}: does not divide the world size {lay.world}")
    if dp_attention and lay.world == 1:
        raise ValueError(f"--enable-dp-attention: needs several ranks to spread attention over ({flag_ep} N, N > 1)")
    if dp_attention and ep != lay.world:
        raise ValueError(f"--enable-dp-attention: needs {flag_ep} = the world size {lay.world} (routed experts "
                         f"spread over every rank), got {flag_ep} {ep}")
    if moe_a2a and ep != lay.world:
        raise ValueError(f"--moe-a2a: all-to-all dispatch/combine needs {flag_ep} = the world size {lay.world}, "
                         f"got {flag_ep} {ep}")
    return lay


def _divisions(cfg: ModelConfig, lay: Layout) -> list[tuple[str, str, int, int]]:
    """(flags, config field, value, parts) of every split the layout implies."""
    t, moe = f"--tp {lay.tp}", f"--tp {lay.tp} --ep {lay.ep}"
    return [(t, "num_attention_heads", cfg.num_attention_heads, lay.attn_tp),
            (t, "intermediate_size", cfg.intermediate_size, lay.attn_tp),
            (t, "vocab_size", cfg.vocab_size, lay.attn_tp),
            (t, "moe_intermediate_size x n_shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts,
             lay.attn_tp),
            (f"--ep {lay.ep}", "n_routed_experts", cfg.n_routed_experts, lay.ep),
            (moe, "moe_intermediate_size", cfg.moe_intermediate_size, lay.moe_tp)]


def _fp8_parts(cfg: ModelConfig, lay: Layout) -> list[tuple[str, str, int, int, str, str]]:
    """(flags, weight, rows or columns one rank keeps, full, 'rows'|'columns', how) of every FP8 split."""
    out = []
    t, heads = f"--tp {lay.tp}", cfg.num_attention_heads // lay.attn_tp
    quant = lambda name: not is_not_converted(cfg, name)  # noqa: E731
    if lay.attn_tp > 1 and quant("model.layers.0.self_attn.q_b_proj"):
        for name, per_head, what in (("q_b_proj", cfg.qk_head_dim, "rows"),
                                     ("kv_b_proj", cfg.qk_nope_head_dim + cfg.v_head_dim, "rows"),
                                     ("o_proj", cfg.v_head_dim, "columns")):
            out.append((t, f"self_attn.{name}", heads * per_head, cfg.num_attention_heads * per_head, what,
                        f"{heads} heads x {per_head}"))
    if lay.attn_tp > 1 and cfg.dense_layers and quant(f"model.layers.{cfg.dense_layers[0]}.mlp.gate_proj"):
        n = cfg.intermediate_size
        out.append((t, "mlp.gate_proj / up_proj / down_proj (dense)", n // lay.attn_tp, n, "rows",
                    f"intermediate_size {n} / {lay.attn_tp}"))
    moe0 = cfg.moe_layers[0] if cfg.moe_layers else None
    if moe0 is not None and lay.attn_tp > 1 and cfg.n_shared_experts and \
            quant(f"model.layers.{moe0}.mlp.shared_experts.gate_proj"):
        n = cfg.moe_intermediate_size * cfg.n_shared_experts
        out.append((t, "mlp.shared_experts", n // lay.attn_tp, n, "rows", f"{n} / {lay.attn_tp}"))
    if moe0 is not None and lay.moe_tp > 1 and quant(f"model.layers.{moe0}.mlp.experts.0.gate_proj"):
        n = cfg.moe_intermediate_size
        out.append((f"--tp {lay.tp} --ep {lay.ep}", "mlp.experts", n // lay.moe_tp, n, "rows",
                    f"moe_intermediate_size {n} split world {lay.world} / ep {lay.ep} = {lay.moe_tp} ways"))
    return out


def check_divisions(cfg: ModelConfig, lay: Layout) -> None:
    """Every split exact; errors like `--tp 3: num_attention_heads 64 is not divisible by 3`."""
    for flags, name, value, parts in _divisions(cfg, lay):
        if parts > 1 and value % parts:
            raise ValueError(f"{flags}: {name} {value} is not divisible by {parts}")


def check_fp8_blocks(cfg: ModelConfig, lay: Layout) -> None:
    """Every rank's part of a quantised weight is whole FP8 blocks (the GPU kernels slice scales by block)."""
    for flags, name, n, full, what, how in _fp8_parts(cfg, lay):
        if n % FP8_BLOCK:
            raise ValueError(f"{flags}: {name} would keep {n} {what} of {full} per rank ({how}), not a multiple "
                             f"of the FP8 block {FP8_BLOCK}; the FP8 GPU kernels need 128-aligned shards (use a "
                             "smaller --tp / --ep, or the CPU reference path, which dequantises before slicing)")


def check_layout(cfg: ModelConfig, tp: int = 1, ep: int = 1, dp_attention: bool = False,
                 keep_fp8: bool = True) -> Layout:
    """Raise ValueError if `cfg` cannot run on this layout; returns it. keep_fp8: the GPU path (FP8 weights
    kept for the kernels) also needs 128-block-aligned parts. Needs no torch.distributed."""
    lay = check_sizes(tp, ep, dp_attention)
    check_divisions(cfg, lay)
    if keep_fp8 and cfg.quantization is not None:
        check_fp8_blocks(cfg, lay)
    return lay


def check_gpu_count(lay: Layout, visible: int, nnodes: int = 1) -> int:
    """Ranks per node for `lay` over `nnodes` machines; ValueError naming both counts if the GPUs are short."""
    _positive("--nnodes", nnodes)
    if lay.world % nnodes:
        raise ValueError(f"--nnodes {nnodes}: does not divide the {lay.world} ranks of {lay.flags}")
    per_node = lay.world // nnodes
    if per_node > visible:
        raise ValueError(f"{lay.flags}: needs {per_node} GPUs per node ({lay.world} ranks over {nnodes} node(s)), "
                         f"this node sees {visible}")
    return per_node
