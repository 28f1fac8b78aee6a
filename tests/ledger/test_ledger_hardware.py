"""Hardware presets: every number has a source; overrides are recorded; bad overrides are named."""

from __future__ import annotations

import pytest

from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS, get_hardware
from dsaserve.ledger.units import parse_tokens

NUMERIC = ("hbm_bytes", "hbm_bw", "bf16_flops", "fp8_flops", "nvlink_bw", "ib_bw", "nvlink_overhead_s", "ib_overhead_s")


@pytest.mark.parametrize("name", ["h200", "h100", "h20", "b200"])
def test_every_preset_number_has_a_source_and_flops_are_dense(name: str):
    hw = PRESETS[name]
    assert set(hw.sources) == set(NUMERIC)
    assert "dense" in hw.sources["fp8_flops"] and "dense" in hw.sources["bf16_flops"]
    assert hw.fp8_flops == pytest.approx(2 * hw.bf16_flops, rel=1e-3)  # FP8 dense = 2x BF16 dense on these parts
    assert all(getattr(hw, f) > 0 for f in NUMERIC)


def test_h200_memory_is_the_measured_total():
    assert PRESETS["h200"].hbm_bytes == 150_109_880_320 and "measured" in PRESETS["h200"].sources["hbm_bytes"]


def test_overrides_are_recorded():
    hw = get_hardware("h100").with_overrides(nvlink_bw=300e9, ib_bw=None)
    assert hw.name == "h100*" and hw.nvlink_bw == 300e9 and hw.ib_bw == PRESETS["h100"].ib_bw
    assert hw.sources["nvlink_bw"] == "command-line override"
    with pytest.raises(ValueError, match="hardware field 'warp': unknown"):
        hw.with_overrides(warp=1.0)
    with pytest.raises(ValueError, match="--hardware: 'tpu' is not a preset"):
        get_hardware("tpu")


def test_token_counts_parse_binary_suffixes():
    assert (parse_tokens("1M"), parse_tokens("128K"), parse_tokens("32768"), parse_tokens("1.5K")) == \
        (2**20, 131072, 32768, 1536)
    with pytest.raises(ValueError, match="--chunk: must be positive"):
        parse_tokens("0", "--chunk")


def test_inputs_validate_with_the_flag_name():
    with pytest.raises(ValueError, match="--gpus: 4 is fewer than --tp 8"):
        Deployment(tp=8, n_gpus=4)
    with pytest.raises(ValueError, match="--kv-layout: 'int4'"):
        Workload(kv_layout="int4")
    with pytest.raises(ValueError, match="--prefix-hit"):
        Workload(prompt=100, prefix_hit=200)
    with pytest.raises(ValueError, match="--indexer-q-tile"):
        Assumptions(indexer_q_tile=0)
    assert Assumptions().with_updates({"speculative": "true", "kernels_per_op": "1.5"}).speculative is True


def test_latency_fit_recovers_the_intercept_and_bandwidth_of_a_sweep():
    from dsaserve.ledger.hardware import fit_latency

    lat, bw = 12e-6, 200e9
    points = [(b, lat + b / bw) for b in (1e3, 4e3, 16e3, 64e3, 256e3)]
    got_lat, got_bw = fit_latency(points)
    assert got_lat == pytest.approx(lat) and got_bw == pytest.approx(bw)
    assert fit_latency([(1e3, 10e-6), (4e3, 9e-6)]) == (pytest.approx(9.5e-6), float("inf"))  # latency-bound
    with pytest.raises(ValueError, match="no .* points"):
        fit_latency([])


def test_h200_nvlink_latency_is_the_named_hook_with_its_source():
    from dsaserve.ledger.hardware import H200_NVLINK_LATENCY_S

    hw = PRESETS["h200"]
    assert hw.nvlink_overhead_s == H200_NVLINK_LATENCY_S
    assert "bench_multi_gpu" in hw.sources["nvlink_overhead_s"]


@pytest.mark.parametrize(("field", "value"), [("hbm_bw", float("nan")), ("bf16_flops", float("inf")),
                                              ("hbm_bw", 0.0), ("ib_overhead_s", -1e-6)])
def test_an_override_that_is_not_a_usable_figure_is_refused(field, value):
    """One rule for the CLI's flags and the Python API (NaN once passed the API and reached the report)."""
    with pytest.raises(ValueError, match=f"hardware {field}: must be"):
        PRESETS["h200"].with_overrides(**{field: value})
    assert PRESETS["h200"].with_overrides(nvlink_overhead_s=0.0).nvlink_overhead_s == 0.0  # a free collective
