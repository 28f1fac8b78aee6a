"""Offline sm_90 compile of the tensor-core sparse MLA kernels: registers, spills, shared memory and the
instructions of the main loop, for every config of bench/sweep_sparse_mla_tc.py (`--kernel tc`) or of
bench/sweep_sparse_mla_swap.py (`--kernel swap`, the swap-AB kernel), without a GPU.

Run anywhere Triton is installed:  PYTHONPATH=. python bench/offline_sm90.py [--kernel swap] [--only a,b]
The launch arguments come from the kernel module's `launch_plan` on CPU tensors of glm-5.3-slice's shapes
(so the integer specialisation is the GPU run's: a value divisible by 16 is marked so, as Triton does), the
kernel is compiled for GPUTarget("cuda", 90, 32), and the wheel's ptxas / cuobjdump read the result. What it
found (Triton 3.9, a stand-in for the H200's 3.6): 8 warps on all 512 output columns spill in the loop and
run S twice (both warpgroups), 4 warps x 32-key tiles x half the columns use 104 KB and no spills.
Loop numbers are static counts of one iteration (one key tile) of one program (a branch counts whole); the
MMA work a token-key is the same ~52 SM cycles in every config (S twice, P @ V once, at 2048 MAC/cycle).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from bench import sweep_sparse_mla_swap, sweep_sparse_mla_tc
from bench.offline_compile import BIN, compile_sm90, ptxas
from dsaserve.common.kv_layout import encode_latent, get_kv_layout
from dsaserve.config import load_config
from dsaserve.kernels import triton_sparse_mla_swap as SWAP
from dsaserve.kernels import triton_sparse_mla_tc as TC

PTR = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.uint8: "*u8", torch.int64: "*i64",
       torch.int32: "*i32"}


def type_of(value) -> str:
    """A launch argument's type in the signature: pointers by dtype, floats fp32, integers i32 unless past 2^31."""
    if isinstance(value, torch.Tensor):
        return PTR[value.dtype]
    if isinstance(value, float):
        return "fp32"
    return "i64" if abs(value) >= 2**31 else "i32"


def loop_census(cubin: Path) -> dict[str, int]:
    """SASS opcode counts of the longest backward branch (the key-tile loop)."""
    sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    lines = [m for m in (re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", ln) for ln in sass.splitlines()) if m]
    loops = [(int(b.group(1), 16), int(m.group(1), 16)) for m in lines
             if (b := re.search(r"BRA (0x[0-9a-f]+)", m.group(2))) and int(b.group(1), 16) < int(m.group(1), 16)]
    lo, hi = max(loops, key=lambda x: x[1] - x[0])
    ops: dict[str, int] = {}
    for m in lines:
        if lo <= int(m.group(1), 16) <= hi:
            op = re.sub(r"^@!?U?P\w+\s+", "", m.group(2)).split(" ")[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
    return ops


def _plan(kernel: str, name: str, t: int):
    """(jit function, launch args, constexprs, programs a token's key tile is read by) of one config at T tokens."""
    cfg_model = load_config("glm-5.3-slice")
    h, dc, dr, k = (cfg_model.num_attention_heads, cfg_model.kv_lora_rank, cfg_model.qk_rope_head_dim,
                    cfg_model.index_topk)
    qn, qr = torch.zeros(t, h, dc, dtype=torch.bfloat16), torch.zeros(t, h, dr, dtype=torch.bfloat16)
    cache = encode_latent(torch.zeros(64, dc + dr), "fp8_ds_mla", dc)
    layout = get_kv_layout("fp8_ds_mla")
    slots = torch.zeros(t, k, dtype=torch.int64)
    if kernel == "swap":
        cfg = SWAP._config(sweep_sparse_mla_swap.CONFIGS[name])
        _, _, grid, args, meta = SWAP.launch_plan(qn, qr, cache, layout, slots, 0.06, torch.empty_like(qn), cfg, 132)
        return SWAP._sparse_mla_swap_kernel, args, meta, grid[2]  # head blocks: programs a token
    cfg = TC._config(layout, sweep_sparse_mla_tc.CONFIGS[name])
    _, _, launches, meta = TC.launch_plan(qn, qr, cache, layout, slots, 0.06, torch.empty_like(qn), cfg, sms=132)
    return TC._sparse_mla_tc_kernel, launches[0][1], meta, meta["DV_SPLIT"]


def report(kernel: str, name: str, t: int) -> str:
    fn, args, meta, programs_a_token = _plan(kernel, name, t)
    compiled = compile_sm90(fn, args, meta, type_of)
    with tempfile.TemporaryDirectory() as tmp:
        regs, spill, cubin = ptxas(compiled, Path(tmp))
        ops = loop_census(cubin)
    total = sum(ops.values())
    # warp instructions a token's key costs: all warps of all programs of the token (the SM issues 4 a cycle)
    per_key = total * meta["num_warps"] * programs_a_token / meta["BLOCK_K"]
    return (f"{kernel:4s} {name:18s} T={t:5d} smem {compiled.metadata.shared / 1024:6.1f} KB  regs {regs:>3s}  "
            f"spill st/ld {spill[0]:>5s}/{spill[1]:<5s} loop: {total:5d} instr, {per_key:5.0f} warp-instr a token-key, "
            f"HGMMA {ops.get('HGMMA', 0):3d}, LDL {ops.get('LDL', 0):3d}, STL {ops.get('STL', 0):3d}, "
            f"LDGSTS (cp.async) {ops.get('LDGSTS', 0):3d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("tc", "swap"), default="tc")
    ap.add_argument("--only", default=None, help="configs (default: all of the kernel's sweep)")
    ap.add_argument("--tokens", default="128,4096", help="token counts (decode T=128, prefill)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless set; 3.6 fuses by default
    configs = (sweep_sparse_mla_swap if args.kernel == "swap" else sweep_sparse_mla_tc).CONFIGS
    for name in (args.only or ",".join(configs)).split(","):
        for t in (int(x) for x in args.tokens.split(",")):
            try:
                print(report(args.kernel, name, t), flush=True)
            except Exception as ex:  # noqa: BLE001 - one config failing (e.g. shared memory) must not stop the rest
                print(f"{args.kernel:4s} {name:18s} T={t:5d} FAILED {type(ex).__name__}: {str(ex)[-300:]}", flush=True)


if __name__ == "__main__":
    main()
