"""bench/offline_spec_sass.py on the shipped spec list's lines, compiled offline for sm_90 (Triton ships ptxas and
cuobjdump): the decode score kernels keep no runtime integer division (their page size is a constexpr since the
forty-fourth stop: a runtime one cost each key an int64 division), and the counter does see one where a kernel
still divides by a runtime page size."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench import offline_spec_sass as sass_audit
from dsaserve.engine import kernel_precompile as kp

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="offline sm_90 compiles need Triton's JIT, not its interpreter")


def _shipped(kernel: str) -> str:
    shipped = sorted(Path(kp.__file__).with_name("kernel_specs").glob("*.jsonl"))
    return next(s for s in kp.read_specs(shipped) if json.loads(s)["name"].endswith("." + kernel))


def _counts(kernel: str, tmp_path, monkeypatch) -> dict[str, int]:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    return sass_audit.count(sass_audit.sass(kp.compiled_kernel(_shipped(kernel))))


@pytest.mark.parametrize("kernel", ["_paged_score_kernel", "_coop_score_select_kernel"])
def test_the_decode_score_kernels_place_keys_without_dividing(kernel, tmp_path, monkeypatch):
    counts = _counts(kernel, tmp_path, monkeypatch)
    assert counts["instructions"] > 500  # a whole kernel was read
    assert counts["udiv32"] == counts["sdiv32"] == counts["int64_div_calls"] == 0, counts


def test_a_runtime_page_size_is_counted(tmp_path, monkeypatch):
    """`_take_all_kernel` still takes the page size at run time (one visible key's slot a thread): its division is
    what the audit counts."""
    assert _counts("_take_all_kernel", tmp_path, monkeypatch)["udiv32"] >= 1
