"""Shared Triton helpers for the GPU kernels (`kernels/triton_*.py`); imported only when Triton is present.

Owns: `opaque_index`, which hides a gathered row index from Triton's alignment analysis. KV rows are
not all 16-byte multiples (indexer rows are 132 B, tiny-config fp8_ds_mla rows 164 B), and Triton 3.6
was seen (PTX of the indexer kernel, offline sm_90 compile) to vectorise a masked row gather of a
132-byte-stride cache as 16-byte loads -> `misaligned address` on the H200. An index that went through
an inline-asm move carries no divisibility facts, so the row base is only assumed as aligned as the
(runtime-specialised) row stride makes it: 16-byte loads stay for 656-byte rows, byte loads for 132.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no inline asm; it needs no such fence

    @triton.jit
    def opaque_index(x):
        return x

else:

    @triton.jit
    def opaque_index(x):
        return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64, is_pure=True, pack=1)
