"""Which Gluon sparse MLA kernel a call launches (`gluon_sparse_mla.launch_plan`, no GPU needed: the plan is built on
CPU tensors, nothing launched): the warp-specialised kernel for unsplit calls from WS_MIN_TOKENS tokens over bf16
rows, the single-partition one below that, for split top-k and when DSASERVE_SPARSE_MLA_WS is 0; over the fp8_ds_mla
cache the decode-schedule kernel (gluon_sparse_mla_dec_fp8) unless cfg "ws" or that switch asks for another; the
launch's registers and warps as the warp-specialised schedule needs them, its A/B switches (cfg["ws_variant"]) passed as
constexprs (DEFAULT_SWITCHES when a call names none); decode splits."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common import envs
from dsaserve.kernels import gluon_sparse_mla as G

pytestmark = pytest.mark.skipif(not G.HAVE_GLUON, reason="needs a Triton with Gluon (>= 3.5)")


def _plan(t: int, rows_dtype=torch.bfloat16, keys: int = 2048, **cfg):
    qn, qr = torch.zeros(t, 64, 512, dtype=torch.bfloat16), torch.zeros(t, 64, 64, dtype=torch.bfloat16)
    rows = torch.zeros(4096, 576 if rows_dtype == torch.bfloat16 else G.FP8_ROW, dtype=rows_dtype)
    slots = torch.zeros(t, keys, dtype=torch.int32)
    return G.launch_plan(qn, qr, rows, slots, 0.06, torch.empty_like(qn), {**G.DEFAULT, **cfg}, sms=132)


def _name(plan) -> str:
    return plan[0].fn.__name__ if hasattr(plan[0], "fn") else plan[0].__name__


def test_prefill_sized_unsplit_calls_take_the_warp_specialised_kernel():
    kernel, part, lse, grid, args, meta = _plan(G.WS_MIN_TOKENS)
    assert _name((kernel,)) == "_sparse_mla_ws_kernel" and grid == (G.WS_MIN_TOKENS, 1, 1)
    # 12 warps x 168 registers: the whole file; the switches measured fastest (DEFAULT_SWITCHES)
    assert meta == {"SPLIT": False, "num_warps": 4, "maxnreg": 168, **G.ws.DEFAULT_SWITCHES}
    assert part.shape[0] == 1  # unsplit: the output itself


@pytest.mark.parametrize("t,cfg", [(G.WS_MIN_TOKENS - 1, {}), (G.WS_MIN_TOKENS, {"splits": 4}),
                                   (4096, {"ws": False})])
def test_small_split_or_switched_off_calls_take_the_single_partition_kernel(t, cfg):
    plan = _plan(t, **cfg)
    assert _name(plan) == "_sparse_mla_gluon_kernel" and plan[5]["num_warps"] == 8


def test_the_switch_turns_the_warp_specialised_kernels_off(monkeypatch):
    monkeypatch.setenv("DSASERVE_SPARSE_MLA_WS", "0")
    envs.reload()
    try:
        assert _name(_plan(4096)) == "_sparse_mla_gluon_kernel"
        assert _name(_plan(128, torch.uint8)) == "_sparse_mla_fp8_kernel"
    finally:
        monkeypatch.delenv("DSASERVE_SPARSE_MLA_WS")
        envs.reload()


def test_forcing_it_takes_split_calls_too_and_the_fp8_cache_keeps_its_kernel():
    kernel, part, lse, grid, args, meta = _plan(64, ws=True, splits=4)
    assert _name((kernel,)) == "_sparse_mla_ws_kernel" and meta["SPLIT"] and grid[2] == part.shape[0] == 4
    assert _name(_plan(4096, torch.uint8, ws=False)) == "_sparse_mla_fp8_kernel"


def test_the_fp8_cache_takes_the_decode_schedule_unless_another_kernel_is_asked_for(monkeypatch):
    assert _name(_plan(4096, torch.uint8)) == _name(_plan(16, torch.uint8)) == "_sparse_mla_dec_fp8_kernel"
    monkeypatch.setattr(G, "FP8_DEFAULT", "single")  # profile_decode's --ab fp8_single
    assert _name(_plan(128, torch.uint8)) == "_sparse_mla_fp8_kernel"
    monkeypatch.undo()
    assert _name(_plan(128, torch.uint8, block_k=32)) == "_sparse_mla_fp8_kernel"  # 64-key blocks only
    kernel, part, lse, grid, args, meta = _plan(128, torch.uint8, ws=True)
    assert _name((kernel,)) == "_sparse_mla_ws_fp8_kernel"
    assert meta == {"SPLIT": grid[2] > 1, "num_warps": 4, "maxnreg": 168, **G.ws_fp8.DEFAULT_SWITCHES}
    assert args[14] == 528  # the rope's byte offset in a 656-byte row


@pytest.mark.parametrize("t,splits", [(256, 1), (128, 1), (96, 1), (64, 2), (32, 3), (16, 6), (1, 16)])
def test_decode_batches_split_to_fill_one_wave_of_programs(t, splits):
    """One program an SM: the fewest splits reaching 0.7 of a wave (132 SMs), at most top-k / 2 blocks."""
    kernel, part, lse, grid, args, meta = _plan(t, torch.uint8)
    assert grid == (t, 1, splits) and part.shape[0] == splits and meta["SPLIT"] == (splits > 1)


def test_the_warp_specialised_kernels_switches_reach_the_launch_and_unknown_ones_are_refused():
    meta = _plan(4096, ws_variant={"PIN": True, "P1_MODE": 1})[5]
    assert meta == {"SPLIT": False, "num_warps": 4, "maxnreg": 168, "PIN": True, "P1_MODE": 1}
    # {}: the kernel's own constexpr defaults (the schedule before DEFAULT_SWITCHES, CANDIDATES' "ws")
    assert set(_plan(4096, ws_variant={})[5]) == {"SPLIT", "num_warps", "maxnreg"}
    for switches in G.ws.CANDIDATES.values():
        assert set(switches) <= set(G.ws.VARIANTS)
        assert set(_plan(4096, ws_variant=switches)[5]) - {"SPLIT", "num_warps", "maxnreg"} == set(switches)
    with pytest.raises(ValueError, match="unknown switches"):
        _plan(4096, ws_variant={"FIXED": True})
    kernel_args = G.ws._sparse_mla_ws_kernel.arg_names
    assert all(name in kernel_args for name in G.ws.VARIANTS)  # every switch is a constexpr of the kernel


def test_the_decode_schedule_is_asked_for_by_name_over_the_fp8_cache():
    """cfg ws "dec": `gluon_sparse_mla_dec_fp8` (4 warps, the whole register file split 192 / 160 / 152), its
    switches (DEFAULT_SWITCHES unless named); bf16 rows never take it."""
    kernel, part, lse, grid, args, meta = _plan(128, torch.uint8, ws="dec", splits=1)
    assert _name((kernel,)) == "_sparse_mla_dec_fp8_kernel" and grid == (128, 1, 1)
    assert meta == {"SPLIT": False, "num_warps": 4, "maxnreg": 168, **G.dec_fp8.DEFAULT_SWITCHES}
    kernel, part, lse, grid, args, meta = _plan(32, torch.uint8, ws="dec", splits=4, ws_variant={"EARLY_ROWS": False})
    assert meta["SPLIT"] and meta["EARLY_ROWS"] is False and "PIN" not in meta and grid[2] == 4
    with pytest.raises(ValueError, match="fp8 cache"):  # bf16 rows have no decode-schedule kernel
        _plan(4096, ws="dec")
    with pytest.raises(ValueError, match="'ws'|ws is"):
        _plan(128, torch.uint8, ws="fast")


def test_the_decode_schedules_unknown_switches_are_refused_and_the_known_ones_are_its_constexprs():
    with pytest.raises(ValueError, match="unknown switches"):
        _plan(128, torch.uint8, ws="dec", ws_variant={"P1_MODE": 1})
    assert set(G.dec_fp8.DEFAULT_SWITCHES) <= set(G.dec_fp8.SWITCHES)
    kernel_args = G.dec_fp8._sparse_mla_dec_fp8_kernel.arg_names
    assert all(name in kernel_args for name in G.dec_fp8.SWITCHES)
