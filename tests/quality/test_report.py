"""`dsaserve eval`'s plan (dsaserve/quality/report.py): which settings run and what each is compared with."""

from __future__ import annotations

from dsaserve.quality.report import EvalArgs, agreement, compare, make_plan, table


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


def test_the_cpu_ref_group_adds_a_bfloat16_cpu_run_and_on_a_gpu_compares_with_both_references():
    cpu = make_plan(EvalArgs(model="m", groups=("cpu_ref",)))
    assert [(s.name, s.dtype) for s in cpu.settings] == [
        ("cpu:fp8_ds_mla", "auto"),
        ("cpu:fp8_ds_mla:bfloat16", "bfloat16"),
    ]
    assert cpu.pairs == [("CPU bfloat16 vs float32 compute", "cpu:fp8_ds_mla:bfloat16", "cpu:fp8_ds_mla")]
    gpu = make_plan(EvalArgs(model="m", device="cuda", kv_layout="bf16", groups=("cpu_ref",)))
    assert [s.name for s in gpu.settings] == ["cuda:bf16", "cpu:bf16", "cpu:bf16:bfloat16"]
    assert {(s, r) for _, s, r in gpu.pairs} == {
        ("cuda:bf16", "cpu:bf16"),
        ("cuda:bf16", "cpu:bf16:bfloat16"),
        ("cpu:bf16:bfloat16", "cpu:bf16"),
    }


def test_the_fp32_head_group_runs_the_gpu_with_a_float32_lm_head_against_the_cpu_and_the_bf16_head():
    plan = make_plan(EvalArgs(model="m", device="cuda", groups=("fp32_head",)))
    head = next(s for s in plan.settings if s.fp32_head)
    assert (head.name, head.device, head.kv_layout) == ("cuda:fp8_ds_mla:fp32head", "cuda", "fp8_ds_mla")
    assert {(s, r) for _, s, r in plan.pairs} == {(head.name, "cpu:fp8_ds_mla"), (head.name, "cuda:fp8_ds_mla")}
    assert "fp32 lm_head" in head.describe()
    assert not any(s.fp32_head for s in make_plan(EvalArgs(model="m", groups=("fp32_head",))).settings)  # GPU only


def test_agreement_reports_each_parting_with_both_runs_margins_at_its_step():
    a, b = [[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], [0, 8, 9]]
    ma, mb = [[0.5, 0.6, 0.7], [1.0, 0.02, 3.0], [0.3, 9.0, 9.0]], [[0.5, 0.6, 0.7], [1.0, 0.01, 3.0], [0.9, 9, 9]]
    got = agreement(a, b, ma, mb)
    assert (got["identical"], got["of"], got["mean_prefix"]) == (1, 3, round(4 / 3, 2))
    assert got["partings"] == [
        {"prompt": 1, "step": 1, "margin": 0.02, "ref_margin": 0.01},
        {"prompt": 2, "step": 0, "margin": 0.3, "ref_margin": 0.9},
    ]
    assert got["max_parting_margin"] == 0.9
    bare = agreement(a, b)  # no margins (an older result): where, but no margins
    assert bare["partings"] == [{"prompt": 1, "step": 1}, {"prompt": 2, "step": 0}]
    assert bare["max_parting_margin"] is None
    assert agreement(a, a, ma, ma)["partings"] == [] and agreement(a, a, ma, ma)["max_parting_margin"] is None


def test_the_table_shows_the_largest_parting_margin_and_lists_the_partings():
    runs = (("x", [[1, 2], [3, 4]], [[1.0, 0.25], [2.0, 2.0]]), ("y", [[1, 5], [3, 4]], [[1.0, 0.5], [2, 2]]))
    res = {n: {"ppl": 10.0, "loss": 2.3, "greedy": g, "margins": m} for n, g, m in runs}
    rows = compare(res, [("x vs y", "x", "y")])
    text = table(res, rows, None)
    assert "max parting margin" in text and "0.500 nats" in text
    assert "x vs y: #0@1 0.250/0.500" in text


def test_the_gpu_fp32_group_runs_the_gpu_in_float32_without_fp8_activations_against_the_cpu_reference():
    plan = make_plan(EvalArgs(model="m", device="cuda", groups=("gpu_fp32",)))
    f32 = next(s for s in plan.settings if s.dtype == "float32")
    assert (f32.device, f32.fp8_act) == ("cuda", False)
    assert ("GPU float32 vs CPU reference", f32.name, "cpu:fp8_ds_mla") in plan.pairs
    assert not any(s.dtype == "float32" for s in make_plan(EvalArgs(model="m", groups=("gpu_fp32",))).settings)


def test_the_graphs_group_replays_the_decode_graphs_with_and_without_the_cublaslt_choices(monkeypatch):
    from dsaserve.kernels import cublaslt_tuning

    monkeypatch.setattr(cublaslt_tuning, "TUNED", True)
    plan = make_plan(EvalArgs(model="m", device="cuda", groups=("graphs",)))
    by_name = {s.name: s for s in plan.settings}
    eager, graphs = by_name["cuda:fp8_ds_mla:chunked"], by_name["cuda:fp8_ds_mla:graphs"]
    torch_gemm = by_name["cuda:fp8_ds_mla:graphs:torch_gemm"]
    assert eager.chunked and not eager.graphs  # the graphs' reference decodes the same rows a step
    assert graphs.graphs and graphs.gemm_tuning and torch_gemm.graphs and not torch_gemm.gemm_tuning
    assert [p[1:] for p in plan.pairs] == [(graphs.name, eager.name), (graphs.name, torch_gemm.name)]
    assert "greedy in CUDA graphs on torch's cuBLAS choices" in torch_gemm.describe()
    monkeypatch.setattr(cublaslt_tuning, "TUNED", False)  # nothing to compare the graphs against but eager
    assert [s.name for s in make_plan(EvalArgs(model="m", device="cuda", groups=("graphs",))).settings] == [
        "cuda:fp8_ds_mla", "cuda:fp8_ds_mla:chunked", "cuda:fp8_ds_mla:graphs"]
    assert all(not s.graphs for s in make_plan(EvalArgs(model="m", device="cpu", groups=("graphs",))).settings)
