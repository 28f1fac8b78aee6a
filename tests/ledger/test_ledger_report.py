"""Report structure: stable JSON keys, round trip, every row has a why, DeepSeek-V3.2 works like GLM-5.3."""

from __future__ import annotations

import json

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.build import SECTIONS, build_report
from dsaserve.ledger.deployment import Deployment
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.render import fmt_value, to_json
from dsaserve.ledger.render.markdown import render_markdown
from dsaserve.ledger.render.text import render_text
from dsaserve.ledger.report import Report

TOP_KEYS = {"schema", "conventions", "model", "deployment", "hardware", "workload", "assumptions", "warnings",
            "sections"}
SECTION_KEYS = ["model_constants", "weights_per_gpu", "kv_bytes", "kv_capacity", "kv_capacity_vs_context",
                "scheduler_pages", "timeline", "operators", "collectives", "bytes_to_time", "decode_step",
                "marginal_vs_batch", "marginal_vs_context", "switch_points", "speculative", "prefill_chunks",
                "prefill_totals", "pd_transfer", "first_request", "notes_check"]
COLUMNS = {  # the documented column keys of the sections other tools read (docs/LEDGER.md)
    "collectives": ["topology", "point", "kind", "calls", "per_token", "message", "total_message", "wire",
                    "nvlink_s", "ib_s", "why"],
    "decode_step": ["term", "bytes", "calls", "time_s", "share", "why"],
    "prefill_chunks": ["chunk", "prefix", "tokens", "gemm_flops", "indexer_flops", "indexer_read", "kv_write",
                       "kv_read", "kv_staged", "collective_calls", "collective_bytes", "compute_s", "memory_s",
                       "comm_s", "lower_bound_s", "why"],
    "marginal_vs_batch": ["batch", "comm_s", "weights_s", "kv_s", "step_s", "why"],
    "kv_capacity_vs_context": ["context", "pages", "requests_fit", "kv_per_request", "why"],
    "notes_check": ["id", "quantity", "note_value", "ledger_value", "unit", "status", "why"],
}


@pytest.fixture(scope="module")
def glm_report() -> Report:
    return build_report(LedgerInputs(load_config("glm-5.3"), Deployment(tp=8, ep=8, dp_attention=True),
                                     PRESETS["h200"]))


def test_json_round_trips_and_keys_are_stable(glm_report: Report):
    d = json.loads(to_json(glm_report))
    assert set(d) == TOP_KEYS and d["schema"] == "dsaserve.ledger/1"
    assert list(d["sections"]) == SECTION_KEYS == list(SECTIONS)
    assert Report.from_dict(d) == glm_report
    assert json.loads(to_json(Report.from_dict(d))) == d
    for key, cols in COLUMNS.items():
        assert [c["key"] for c in d["sections"][key]["columns"]] == cols
    assert set(d["conventions"]) >= {"bytes", "tokens", "comm_bytes", "ring"}
    assert "mla_kv" in d["assumptions"] and "mla_kv" in d["assumptions"]["_why"]


def test_every_row_of_every_section_says_why(glm_report: Report):
    for sec in glm_report.sections:
        assert sec.rows, sec.key
        for row in sec.rows:
            assert isinstance(row.get("why"), str), (sec.key, row)


def test_notes_check_only_by_default_for_glm_53():
    ds = build_report(LedgerInputs(load_config("deepseek-v3.2"), Deployment(tp=8), PRESETS["h200"]))
    assert not ds.has("notes_check")
    forced = build_report(LedgerInputs(load_config("deepseek-v3.2"), Deployment(tp=8), PRESETS["h200"]),
                          ["kv_bytes"], with_notes=True)
    assert [s.key for s in forced.sections] == ["kv_bytes", "notes_check"]


def test_a_config_only_named_glm_53_gets_no_notes_check(tmp_path):
    """The notes check compares with the built-in GLM-5.3: a file named glm-5.3.json with other values is another
    model (its name is the file's stem), so it is left out by default."""
    cfg = load_config("glm-5.3")
    (tmp_path / "glm-5.3.json").write_text(json.dumps({**cfg.to_hf_dict(), "index_topk": 4096}))
    other = load_config(tmp_path / "glm-5.3.json")
    assert other.name == "glm-5.3"
    assert not build_report(LedgerInputs(other, Deployment(tp=8), PRESETS["h200"])).has("notes_check")


def test_deepseek_v32_report_uses_its_own_dims():
    r = build_report(LedgerInputs(load_config("deepseek-v3.2"), Deployment(tp=8, ep=8, dp_attention=True),
                                  PRESETS["h200"]), ["kv_bytes", "collectives", "prefill_totals", "operators"])
    fp8 = r.section("kv_bytes").rows[0]
    assert fp8["total_per_token"] == 61 * 656 + 61 * 132
    dispatch = r.section("collectives").row(point="MoE dispatch (FP8)")
    assert dispatch["calls"] == 58 and dispatch["message"] == 4 * 8 * 7168  # ceil(32/8) tokens per DP rank
    assert r.section("operators").row(no=5)["decode"] == 61


def test_unknown_section_is_named():
    with pytest.raises(ValueError, match="--sections: 'nope' unknown"):
        build_report(LedgerInputs(load_config("glm-5.3-tiny"), Deployment(tp=1), PRESETS["h200"]), ["nope"])


def test_text_and_markdown_print_the_conventions_and_every_section(glm_report: Report):
    text, md = render_text(glm_report), render_markdown(glm_report)
    for s in ("GB = 10^9 B", "2^20", "sender totals", "2(n-1)/n"):
        assert s in text and s in md
    for sec in glm_report.sections:
        assert f"[{sec.key}]" in text and f"## {sec.title}" in md


@pytest.mark.parametrize("v, unit, s", [(493_879_296, "B", "493.9 MB"), (6.27e-4, "s", "627 us"),
                                        (9.4e16, "FLOP", "94 PFLOP"), (0.834, "%", "83.4 %"), (1563, "", "1,563"),
                                        (None, "B", "-"), (3.714, "x", "3.71x"), (2.5e-9, "s", "2.5 ns")])
def test_value_formatting(v, unit, s):
    assert fmt_value(v, unit) == s
