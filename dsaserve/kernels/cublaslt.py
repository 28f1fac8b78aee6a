"""cuBLASLt's GEMMs called directly (ctypes), so a decode projection can run an algorithm of our choosing (issue 17).

Owns: the binding (the library, one handle a device, one workspace a device and stream kind), `Gemm` (one shape's
descriptors: its candidates, a check, a run) and `algo_config` (what an algorithm is).

`torch._scaled_mm` and `F.linear` ask cuBLASLt's heuristic for one algorithm and run it. At decode sizes that one
is a 128 x 128 tile a CTA over the whole K (o_proj at 128 rows: 48 CTAs on 132 SMs), ~0.6 of the HBM ceiling
(bench/RESULTS.md, forty-second session). The heuristic has more candidates (split K, other tiles and clusters);
this module lists them (`Gemm.algos`), runs any of them (`Gemm.run`), and says what each is (`algo_config`), for the
probe that times them (`bench/probe_cublaslt_algos.py`) and for the engine's projections where one wins.

The library is the one torch itself loaded (found in /proc/self/maps after a first cuBLAS call), so the calls share
its CUDA context and version. Layouts follow torch's own `_scaled_mm` call: cuBLAS is column-major, so y [M, N] =
x [M, K] W^T is computed as y^T = W x^T with A = W (transposed, K contiguous), B = x, D = y^T (ld N). Block
scaling: A (the weight) 128 x 128 blocks, [N/128, K/128] row-major with K/128 a multiple of 4 (cuBLAS's leading
dimension); B (the tokens) 1 x 128, outer-dim-major ([K/128, M] storage), M a multiple of 16.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from dataclasses import dataclass

import torch

# cudaDataType_t, cublasComputeType_t, cublasOperation_t (library_types.h, cublas_api.h)
CUDA_R_32F, CUDA_R_16BF, CUDA_R_8F_E4M3 = 0, 14, 28
CUBLAS_COMPUTE_32F = 68
OP_N, OP_T = 0, 1
# cublasLtMatmulDescAttributes_t, cublasLtMatmulMatrixScale_t, cublasLtMatmulPreferenceAttributes_t (cublasLt.h)
DESC_TRANSA, DESC_TRANSB, DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 3, 4, 17, 18
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5
PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t: (name, id, ctypes type)
ALGO_CONFIG = (("algo_id", 0, ctypes.c_int32), ("tile", 1, ctypes.c_uint32), ("split_k", 2, ctypes.c_int32),
               ("reduction", 3, ctypes.c_uint32), ("swizzle", 4, ctypes.c_uint32), ("custom", 5, ctypes.c_uint32),
               ("stages", 6, ctypes.c_uint32), ("inner_shape", 7, ctypes.c_uint16),
               ("cluster", 8, ctypes.c_uint16))
# torch's cuBLAS (not Lt) workspace on sm_90; torch's cuBLASLt calls get 1 MB unless CUBLASLT_WORKSPACE_SIZE says
# otherwise, too little for the split-K algorithms the narrow FP8 projections gain by (2.8-6 MB)
WORKSPACE_BYTES = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    pass


@functools.cache
def library() -> ctypes.CDLL:
    """The libcublasLt torch loaded (a first bf16 matmul loads it)."""
    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcublasLt.so" in line}
    if not paths:
        raise CublasLtError("cublaslt: torch has no libcublasLt loaded (not a CUDA build?)")
    return ctypes.CDLL(sorted(paths)[0])


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"cublaslt: {what} returned cublasStatus {status}")


def _call(name: str, *args) -> None:
    _check(getattr(library(), name)(*args), name)


def _set(fn: str, obj: ctypes.c_void_p, attr: int, value) -> None:
    _call(fn, obj, ctypes.c_int(attr), ctypes.byref(value), ctypes.c_size_t(ctypes.sizeof(value)))


@functools.cache
def handle(device_index: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _call("cublasLtCreate", ctypes.byref(h))
    return h


def _handle() -> ctypes.c_void_p:
    return handle(torch.cuda.current_device())


@functools.cache
def workspace(device_index: int, side: bool) -> torch.Tensor:
    """One workspace per device for the compute streams and one for the step's high-priority side stream, whose
    GEMMs may run beside the compute stream's (torch keeps one a stream too). Made once, before any capture
    (`cublaslt_tuning.tune`): one first made inside a capture would belong to that graph's memory pool."""
    if torch.cuda.is_current_stream_capturing():
        raise CublasLtError("cublaslt: a workspace is made before any capture (cublaslt_tuning.tune makes them)")
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


def _layout(dtype: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
    lay = ctypes.c_void_p()
    _call("cublasLtMatrixLayoutCreate", ctypes.byref(lay), ctypes.c_int(dtype), ctypes.c_uint64(rows),
          ctypes.c_uint64(cols), ctypes.c_int64(ld))
    return lay


def _destroy(desc: ctypes.c_void_p, layouts: tuple[ctypes.c_void_p, ...]) -> None:
    """A `Gemm`'s descriptors freed (host memory only: no stream or device work to wait for)."""
    for lay in layouts:
        library().cublasLtMatrixLayoutDestroy(lay)
    library().cublasLtMatmulDescDestroy(desc)


def algo_config(algo: Algo) -> dict[str, int]:
    """What an algorithm is (tile, split K, stages, cluster ids: cublasLt.h's enums)."""
    out = {}
    for name, attr, ctype in ALGO_CONFIG:
        v, written = ctype(), ctypes.c_size_t()
        status = library().cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), ctypes.c_int(attr),
                                                                ctypes.byref(v), ctypes.c_size_t(ctypes.sizeof(v)),
                                                                ctypes.byref(written))
        out[name] = int(v.value) if status == 0 else -1
    return out


@dataclass
class Candidate:
    algo: Algo
    workspace: int
    waves: float

    def config(self) -> dict[str, int]:
        return algo_config(self.algo)


class Gemm:
    """y [m, n] = x [m, k] @ W[n, k]^T of one shape: cuBLASLt's descriptors made once, any algorithm run.

    fp8=True: x and W e4m3 with block scales (x 1 x 128 outer-dim-major, W 128 x 128), y bf16; m a multiple of 16.
    fp8=False: x and W bf16, y bf16. tokens_as_a: x is cuBLAS's A and W its B (cuBLAS's own block-scaled sample's
    order), so `run` writes y^T [n, m] row-major; else W is A (torch's order) and `run` writes y [m, n]."""

    def __init__(self, m: int, n: int, k: int, fp8: bool, tokens_as_a: bool = False) -> None:
        self.m, self.n, self.k, self.fp8, self.tokens_as_a = m, n, k, fp8, tokens_as_a
        self.desc = ctypes.c_void_p()
        _call("cublasLtMatmulDescCreate", ctypes.byref(self.desc), ctypes.c_int(CUBLAS_COMPUTE_32F),
              ctypes.c_int(CUDA_R_32F))
        _set("cublasLtMatmulDescSetAttribute", self.desc, DESC_TRANSA, ctypes.c_int32(OP_T))
        _set("cublasLtMatmulDescSetAttribute", self.desc, DESC_TRANSB, ctypes.c_int32(OP_N))
        if fp8:
            modes = (SCALE_VEC128_32F, SCALE_BLK128x128_32F) if tokens_as_a else (SCALE_BLK128x128_32F,
                                                                                   SCALE_VEC128_32F)
            _set("cublasLtMatmulDescSetAttribute", self.desc, DESC_A_SCALE_MODE, ctypes.c_int32(modes[0]))
            _set("cublasLtMatmulDescSetAttribute", self.desc, DESC_B_SCALE_MODE, ctypes.c_int32(modes[1]))
        src = CUDA_R_8F_E4M3 if fp8 else CUDA_R_16BF
        w_layout, x_layout = _layout(src, k, n, k), _layout(src, k, m, k)  # row-major [rows, k] = column-major
        self.a_layout, self.b_layout = (x_layout, w_layout) if tokens_as_a else (w_layout, x_layout)
        # D column-major: [m, n] (ld m) is y^T row-major; [n, m] (ld n) is y row-major
        self.d_layout = _layout(CUDA_R_16BF, m, n, m) if tokens_as_a else _layout(CUDA_R_16BF, n, m, n)
        self.out_shape = (n, m) if tokens_as_a else (m, n)
        # tuning makes a Gemm for every candidate shape and row count; each one's descriptors go with it
        self._finalizer = weakref.finalize(self, _destroy, self.desc, (w_layout, x_layout, self.d_layout))
        self._finalizer.atexit = False  # the process's end frees them anyway
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def set_scales(self, x_scale: torch.Tensor | None, w_scale: torch.Tensor | None) -> None:
        """The block scales' device pointers (fp8): the heuristic and the check refuse a block-scaled
        descriptor without them (cublasStatus 7), and each run reads them from the descriptor."""
        if self.fp8:
            a, b = (x_scale, w_scale) if self.tokens_as_a else (w_scale, x_scale)
            _set("cublasLtMatmulDescSetAttribute", self.desc, DESC_A_SCALE_POINTER, ctypes.c_void_p(a.data_ptr()))
            _set("cublasLtMatmulDescSetAttribute", self.desc, DESC_B_SCALE_POINTER, ctypes.c_void_p(b.data_ptr()))

    def algos(self, count: int = 32, x_scale: torch.Tensor | None = None,
              w_scale: torch.Tensor | None = None) -> list[Candidate]:
        """The heuristic's candidates, best-first by its own ranking (with this workspace the first may split K
        where torch's call, with 1 MB, does not); fp8 needs the scales (only their addresses are read here)."""
        self.set_scales(x_scale, w_scale)
        pref = ctypes.c_void_p()
        _call("cublasLtMatmulPreferenceCreate", ctypes.byref(pref))
        try:
            _set("cublasLtMatmulPreferenceSetAttribute", pref, PREF_MAX_WORKSPACE_BYTES,
                 ctypes.c_uint64(WORKSPACE_BYTES))
            results, returned = (HeuristicResult * count)(), ctypes.c_int()
            _call("cublasLtMatmulAlgoGetHeuristic", _handle(), self.desc, self.a_layout, self.b_layout, self.d_layout,
                  self.d_layout, pref, ctypes.c_int(count), results, ctypes.byref(returned))
        finally:
            library().cublasLtMatmulPreferenceDestroy(pref)
        return [Candidate(r.algo, int(r.workspace_size), float(r.waves))
                for r in results[:returned.value] if r.state == 0]

    def supports(self, algo: Algo, x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> bool:
        """Whether `algo` (found for another row count, say) runs this shape (cublasLtMatmulAlgoCheck)."""
        self.set_scales(x_scale, w_scale)
        result = HeuristicResult()
        return library().cublasLtMatmulAlgoCheck(_handle(), self.desc, self.a_layout, self.b_layout, self.d_layout,
                                                 self.d_layout, ctypes.byref(algo), ctypes.byref(result)) == 0 \
            and result.workspace_size <= WORKSPACE_BYTES

    def run(self, algo: Algo | None, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None) -> torch.Tensor:
        """out (bf16, contiguous, `out_shape`) = x @ W^T (or its transpose) on the current stream with `algo`
        (None: the heuristic's first). Inputs as the class says; nothing is checked here beyond the shapes."""
        if tuple(x.shape) != (self.m, self.k) or tuple(w.shape) != (self.n, self.k) or \
                tuple(out.shape) != self.out_shape:
            raise ValueError(f"cublaslt: Gemm({self.m}, {self.n}, {self.k}) called with x {tuple(x.shape)}, "
                             f"w {tuple(w.shape)}, out {tuple(out.shape)}")
        self.set_scales(x_scale, w_scale)
        current = torch.cuda.current_stream(x.device)
        ws = workspace(x.device.index, current.priority < 0)
        stream = ctypes.c_void_p(current.cuda_stream)
        a, b = (x, w) if self.tokens_as_a else (w, x)
        with torch.cuda.device(x.device):
            self._matmul(a, b, out, algo, ws, stream)
        return out

    def _matmul(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, algo: Algo | None, ws: torch.Tensor,
                stream: ctypes.c_void_p) -> None:
        _call("cublasLtMatmul", _handle(), self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(a.data_ptr()),
              self.a_layout, ctypes.c_void_p(b.data_ptr()), self.b_layout, ctypes.byref(self.beta),
              ctypes.c_void_p(out.data_ptr()), self.d_layout, ctypes.c_void_p(out.data_ptr()), self.d_layout,
              ctypes.byref(algo) if algo is not None else None, ctypes.c_void_p(ws.data_ptr()),
              ctypes.c_size_t(WORKSPACE_BYTES), stream)
