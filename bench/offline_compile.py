"""Offline sm_90 compile of one Triton kernel launch, without a GPU: the launch's specialisation, the compile for
GPUTarget("cuda", 90, 32) and ptxas' registers and spills (bench/offline_sm90.py: the sparse MLA kernels,
bench/offline_moe_prefill.py: the MoE prefill GEMMs). The wheel's own ptxas / cuobjdump read the result.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def specialise(fn, args: tuple, meta: dict, type_of: Callable[[object], str]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) as a launch with these arguments would specialise them: each argument typed
    by `type_of`, a tensor 16-byte aligned or an i32 / i64 divisible by 16 marked so, as Triton does."""
    sig, attrs, consts = {}, {}, {}
    names = list(fn.arg_names)
    for i, (name, value) in enumerate(zip(names[:len(args)], args, strict=True)):
        sig[name] = type_of(value)
        if isinstance(value, torch.Tensor):
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, int):
            aligned = value % 16 == 0 and sig[name] in ("i32", "i64")
        else:
            aligned = False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in names[len(args):]:
        sig[name] = "constexpr"
        consts[name] = meta.get(name, False)  # PDL: off offline
    return sig, consts, attrs


def compile_sm90(fn, args: tuple, meta: dict, type_of: Callable[[object], str]):
    """The compiled kernel of `fn` launched with `args` and constexprs / num_warps / num_stages / maxnreg `meta`, for
    sm_90."""
    sig, consts, attrs = specialise(fn, args, meta, type_of)
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # Gluon kernels (kernels/gluon_*.py) compile from their own source
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": meta["num_warps"], "num_stages": meta.get("num_stages", 1),
                                   **({"maxnreg": meta["maxnreg"]} if "maxnreg" in meta else {})})


def ptxas(compiled, out_dir: Path) -> tuple[str, tuple[str, str], Path]:
    """ptxas -v (sm_90a) on a compiled kernel's PTX: (registers, (spill store bytes, spill load bytes), the cubin,
    written under `out_dir`)."""
    ptx, cubin = out_dir / "k.ptx", out_dir / "k.cubin"
    ptx.write_text(compiled.asm["ptx"])
    tool = BIN / ("ptxas-blackwell" if (BIN / "ptxas-blackwell").exists() else "ptxas")
    v = subprocess.run([tool, "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True,
                       check=True).stderr
    regs = re.search(r"Used (\d+) registers", v).group(1)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", v).groups()
    return regs, spill, cubin
