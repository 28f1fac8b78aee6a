"""Environment switches: every `DSASERVE_*` variable the package reads, declared once and read once.

Owns: the table of switches (name, default, what it does), one snapshot of them taken when this module is
first imported (process start-up), `reload()` that takes it again (a test or an A/B script that changed
os.environ: a switch flipped after start-up changes nothing until then), `override()`, switches changed for
one block of this process without touching os.environ (`dsaserve eval`'s A/B settings), and
`set_switches()`, the ones the environment set, for the startup manifest. Read a switch as an attribute,
`envs.DSASERVE_PDL` (vLLM's envs.py, mini-sglang's env.py); a value that must be checked is checked where it
is used, so its error names the place. Variables of other tools (TRITON_*, RANK / WORLD_SIZE / MASTER_*)
stay with the code that hands them on.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


@dataclass(frozen=True)
class Switch:
    default: Any
    parse: Callable[[str], Any]
    help: str
    secret: bool = False  # shown as "<set>" in the manifest, never its value


def _on_unless_zero(raw: str) -> bool:
    return raw.strip() != "0"


def _on_unless_exactly_zero(raw: str) -> bool:
    return raw != "0"


def _text(raw: str) -> str | None:
    return raw or None


SWITCHES: dict[str, Switch] = {
    "DSASERVE_KERNELS": Switch(
        "auto", lambda raw: raw.strip().lower() or "auto",
        "'reference': the PyTorch reference kernels everywhere (debugging, bisecting)"),
    "DSASERVE_FP8_ACTIVATIONS": Switch("1", str.strip, "'0': the GPU FP8 GEMMs keep their activations bf16"),
    "DSASERVE_INDEXER_PREFILL": Switch(
        "gemm", lambda raw: raw.strip().lower() or "gemm",
        "'stream': prefill indexer batches take the streaming top-k kernel (triton_indexer_prefill), not the tiled "
        "score GEMM + select (triton_indexer_gemm: 1.46-1.77x the streaming kernel on the H200)"),
    "DSASERVE_ROW_ARGMAX": Switch(
        "torch", lambda raw: raw.strip().lower() or "torch",
        "'triton': the sampler's argmax is the split-row Triton kernel (kernels/triton_argmax.py), not torch's: "
        "faster inside a CUDA graph up to 64 bf16 rows, but its eager launch costs ~80 us against torch's ~30 on the "
        "H200 (bench_row_argmax.py), and the sampler runs eagerly"),
    "DSASERVE_PDL": Switch(
        True, _on_unless_exactly_zero, "'0': launch the Triton kernels without programmatic dependent launch"),
    "DSASERVE_GRAPH_H2D": Switch(
        True, _on_unless_exactly_zero, "'0': copy a replayed step's inputs outside its CUDA graph"),
    "DSASERVE_OVERLAP_INDEXER": Switch(
        True, _on_unless_zero, "'0': the full layers' indexer selection on the compute stream, not a side stream"),
    "DSASERVE_SYMM_MEM": Switch(
        True, _on_unless_zero, "'0': every all-reduce through NCCL, none through symmetric memory"),
    "DSASERVE_FP32_LM_HEAD": Switch(
        False, lambda raw: raw.strip() == "1",
        "'1': the lm_head writes float32 logits from bf16 inputs (no bf16 rounding of the logits; SGLang's "
        "--enable-fp32-lm-head), the `fp32_head` comparison of `dsaserve eval`"),
    "DSASERVE_WARMUP_CORES_ONLY": Switch(
        False, lambda raw: raw.strip() == "1",
        "'1': warmup runs only the attention cores of each shape on the replayed buckets' buffers (not yet "
        "measured on a GPU: the A/B for issue 16's warm start)"),
    "DSASERVE_SPARSE_MLA_CONFIG": Switch(
        None, _text, "JSON overrides of the GPU sparse MLA's tiling for 3+ tokens, e.g. '{\"block_k\": 64}' "
        "(keys of triton_sparse_mla.sparse_mla_attention's config; a sweep's winner tried in a whole model)"),
    "DSASERVE_PRECOMPILE": Switch(
        True, _on_unless_zero, "'0': no parallel precompile of the recorded Triton kernel specs at start-up "
        "(engine/kernel_precompile.py; the A/B for issue 16's cold start)"),
    "DSASERVE_WARM_START": Switch(
        True, _on_unless_zero, "'0': no warm-start record (engine/warm_start.py): no kernel preload, no cached "
        "memory profile, the full forward shape warmup every start (the A/B for issue 16's warm start)"),
    "DSASERVE_EARLY_CUDA": Switch(
        True, _on_unless_zero, "'0': a rank creates its CUDA context when torch first needs it, not on a thread "
        "while torch imports (engine/early_cuda.py; the A/B for issue 16's warm start)"),
    "DSASERVE_PREFILL_STAGING": Switch(
        True, _on_unless_zero, "'0': prefill sparse MLA reads the fp8_ds_mla cache itself, not its rows dequantised "
        "once a layer to bf16 (model/layers/prefill_staging.py; the A/B for issue 17's prefill)"),
    "DSASERVE_SPARSE_MLA_GLUON": Switch(
        True, _on_unless_zero, "'0': sparse MLA over bf16 rows (a prefill's staged rows, the bf16 cache) runs the "
        "Triton kernel, not the Gluon one (kernels/gluon_sparse_mla.py; the A/B for issue 17)"),
    "DSASERVE_SPARSE_MLA_WS": Switch(
        True, _on_unless_zero, "'0': the Gluon sparse MLA runs its single-partition kernels, not the "
        "warp-specialised ones (over bf16 rows kernels/gluon_sparse_mla_ws.py, over the fp8 cache "
        "kernels/gluon_sparse_mla_dec_fp8.py; the A/B for issue 17)"),
    "DSASERVE_MOE_PREFILL_GEMM": Switch(
        None, lambda raw: raw.strip().lower() or None, "'triton' / 'cublas': the FP8 MoE prefill's expert GEMMs "
        "(kernels/triton_moe_prefill.py's grouped GEMM, or a block-scaled cuBLAS GEMM an expert: "
        "kernels/cublas_moe_prefill.py) whatever the size; unset, PREFILL_CONFIG's 'auto' (the A/B for issue 17)"),
    "DSASERVE_GEMM_TUNING": Switch(
        True, _on_unless_zero, "'0': the 33-512-row FP8 projections and the 1-32-row lm_head on torch's own cuBLAS "
        "algorithm; else each is timed against cuBLASLt's candidates at start-up and the fastest runs in the CUDA "
        "graphs (kernels/cublaslt_tuning.py; the A/B for issue 17)"),
    "DSASERVE_STARTUP_PROFILE": Switch(
        None, _text, "a directory: each scheduler rank's start-up under cProfile, written there as "
        "startup-rank<N>.prof and a text summary, startup-rank<N>.txt (finding a slow start's Python)"),
    "DSASERVE_PYCACHE": Switch(
        True, _on_unless_zero, "'0': Python's bytecode where Python's defaults put it, even when the packages cannot "
        "be written (common/bytecode_cache.py: else under the dsaserve cache)"),
    "DSASERVE_KERNEL_SPECS": Switch(None, _text, "more Triton kernel spec lists to precompile (os.pathsep-separated)"),
    "DSASERVE_CACHE_DIR": Switch(None, _text, "cache root (~/.cache/dsaserve): built-in checkpoints, compiled "
                                 "kernels, warm-start records, bytecode (`cache_root()`)"),
    "DSASERVE_MAX_CHECKPOINT_GB": Switch(None, str, "largest built-in checkpoint written on first use (16)"),
    "DSASERVE_BENCH_STEP_SCRIPT": Switch(None, _text, "the script `dsaserve bench step` runs"),
    "DSASERVE_TEST_READY_DELAY_S": Switch(None, _text, "test hook: the scheduler waits this long before ready"),
    "DSASERVE_TEST_DOWN_EXIT_GRACE_S": Switch(
        None, _text, "test hook: seconds the HTTP process stays up reporting Down after a fault after Up (1)"),
    "DSASERVE_API_KEY": Switch(None, _text, "the server's API key when --api-key is not given (vLLM: VLLM_API_KEY); "
                               "also the key `bench serve` sends", secret=True),
}

if TYPE_CHECKING:  # what attribute access returns (see __getattr__)
    DSASERVE_KERNELS: str
    DSASERVE_ROW_ARGMAX: str
    DSASERVE_FP8_ACTIVATIONS: str
    DSASERVE_INDEXER_PREFILL: str
    DSASERVE_PDL: bool
    DSASERVE_GRAPH_H2D: bool
    DSASERVE_OVERLAP_INDEXER: bool
    DSASERVE_SYMM_MEM: bool
    DSASERVE_FP32_LM_HEAD: bool
    DSASERVE_WARMUP_CORES_ONLY: bool
    DSASERVE_SPARSE_MLA_CONFIG: str | None
    DSASERVE_PRECOMPILE: bool
    DSASERVE_WARM_START: bool
    DSASERVE_PREFILL_STAGING: bool
    DSASERVE_SPARSE_MLA_GLUON: bool
    DSASERVE_SPARSE_MLA_WS: bool
    DSASERVE_MOE_PREFILL_GEMM: str | None
    DSASERVE_GEMM_TUNING: bool
    DSASERVE_STARTUP_PROFILE: str | None
    DSASERVE_PYCACHE: bool
    DSASERVE_KERNEL_SPECS: str | None
    DSASERVE_CACHE_DIR: str | None
    DSASERVE_MAX_CHECKPOINT_GB: str | None
    DSASERVE_BENCH_STEP_SCRIPT: str | None
    DSASERVE_TEST_READY_DELAY_S: str | None
    DSASERVE_TEST_DOWN_EXIT_GRACE_S: str | None
    DSASERVE_API_KEY: str | None

_raw: dict[str, str] = {}
_values: dict[str, Any] = {}


def reload() -> None:
    """Read every switch from os.environ again."""
    global _raw, _values
    _raw = {name: os.environ[name] for name in SWITCHES if name in os.environ}
    _values = {}


@contextlib.contextmanager
def override(**switches: str) -> Iterator[None]:
    """Within the block the switches read as if the environment held these raw values; os.environ is never
    written (child processes and other code see nothing) and the snapshot before is back afterwards, error
    or not. A `reload()` inside the block drops the override."""
    global _raw, _values
    unknown = sorted(set(switches) - set(SWITCHES))
    if unknown:
        raise KeyError(f"override: {unknown[0]} is not a declared switch")
    saved = _raw, _values
    _raw, _values = {**_raw, **switches}, {}
    try:
        yield
    finally:
        _raw, _values = saved


def set_switches() -> dict[str, str]:
    """The switches the environment set (as written), for the startup manifest."""
    return {k: "<set>" if SWITCHES[k].secret else v for k, v in _raw.items()}


def cache_root() -> Path:
    """dsaserve's cache root: DSASERVE_CACHE_DIR, else ~/.cache/dsaserve (built-in checkpoints, compiled kernels,
    warm-start records, bytecode)."""
    return Path(__getattr__("DSASERVE_CACHE_DIR") or "~/.cache/dsaserve").expanduser()


def __getattr__(name: str) -> Any:
    switch = SWITCHES.get(name)
    if switch is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _values:
        _values[name] = switch.parse(_raw[name]) if name in _raw else switch.default
    return _values[name]


reload()
