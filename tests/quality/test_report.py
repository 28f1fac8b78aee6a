"""`dsaserve eval`'s plan (dsaserve/quality/report.py): which settings run and what each is compared with."""

from __future__ import annotations

from dsaserve.quality.report import EvalArgs, make_plan


def test_the_hf_group_pairs_every_layout_it_runs_with_hf_through_that_layouts_codec():
    plan = make_plan(EvalArgs(model="m", device="cuda", groups=("kv", "hf")))
    hf = {s.name: s for s in plan.settings if s.hf}
    assert set(hf) == {"hf:fp32", "hf:bf16", "hf:fp8_ds_mla", "hf:fp8_e4m3"}
    assert all(s.device == "cpu" and s.kv_layout == name.split(":")[1] for name, s in hf.items())
    pairs = {(setting, ref) for q, setting, ref in plan.pairs if ref.startswith("hf:")}
    assert pairs == {(f"cuda:{x}", f"hf:{x}") for x in ("fp32", "bf16", "fp8_ds_mla", "fp8_e4m3")}
    assert plan.settings[0].name == "cuda:fp8_ds_mla"  # the engine's settings first, the oracles after
    alone = make_plan(EvalArgs(model="m", kv_layout="bf16", groups=("hf",)))
    assert [s.name for s in alone.settings] == ["cpu:bf16", "hf:bf16"]
    assert alone.pairs == [("KV bf16 vs HF, same codec", "cpu:bf16", "hf:bf16")]
