"""`dsaserve ledger`: flags, formats, plots, errors naming the flag, and no torch import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsaserve.cli import main
from dsaserve.ledger.hardware import PRESETS

LAT = PRESETS["h200"].nvlink_overhead_s  # the per-collective latency the H200 preset assumes (or measured)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["ledger", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_default_text_report(capsys):
    rc, out, _ = _run(capsys, "--sections", "kv_bytes,collectives")
    assert rc == 0
    assert "conventions:" in out and "[kv_bytes]" in out and "[collectives]" in out and "656 B" in out


def test_json_flags_reach_the_report(capsys):
    rc, out, _ = _run(capsys, "--json", "--model", "deepseek-v3.2", "--tp", "4", "--ep", "8", "--gpus", "8",
                      "--dp-attention", "--pd", "--hardware", "b200", "--hbm-tbs", "7", "--kv-layout", "nvfp4_ds_mla",
                      "--context", "256K", "--batch", "64", "--chunk", "16K", "--mem-fraction-static", "0.8",
                      "--indexer-q-tile", "4", "--mla-kv", "split", "--assume", "expert_routing=all",
                      "--sections", "kv_capacity,prefill_totals")
    assert rc == 0
    d = json.loads(out)
    assert d["model"]["name"] == "deepseek-v3.2"
    assert {k: d["deployment"][k] for k in ("tp", "ep", "dp_attention", "pd", "n_gpus")} == \
        {"tp": 4, "ep": 8, "dp_attention": True, "pd": True, "n_gpus": 8}
    assert d["hardware"]["name"] == "b200*" and d["hardware"]["hbm_bw"] == 7e12
    assert d["workload"]["kv_layout"] == "nvfp4_ds_mla" and d["workload"]["context"] == 2**18
    assert d["workload"]["chunk"] == 16384 and d["workload"]["batch"] == 64
    a = d["assumptions"]
    assert (a["mem_fraction_static"], a["indexer_q_tile"], a["mla_kv"], a["expert_routing"]) == (0.8, 4, "split", "all")
    assert list(d["sections"]) == ["kv_capacity", "prefill_totals"]


def test_dp_attention_decode_step_and_bytes_to_time_count_one_ranks_tokens(capsys):
    rc, out, _ = _run(capsys, "--json", "--tp", "8", "--ep", "8", "--dp-attention", "--batch", "32",
                      "--sections", "decode_step,bytes_to_time")
    assert rc == 0
    d = json.loads(out)["sections"]
    a2a = next(r for r in d["decode_step"]["rows"] if r["term"] == "MoE dispatch + combine")
    sent = 75 * 4 * 8 * 6144 * 3  # ceil(32/8) = 4 tokens per DP rank
    assert a2a["bytes"] == pytest.approx(sent * 7 / 8)  # 38.7 MB leaves the GPU (was the deployment's 353.9 MB)
    assert a2a["time_s"] == pytest.approx(sent * 7 / 8 / 450e9 + 150 * LAT)
    layer = next(r for r in d["bytes_to_time"]["rows"] if "dispatch" in r["case"])
    assert layer["message"] == 32 * 8 * 6144 * 3  # b = 256: one rank's ceil(256/8) = 32 tokens, one layer
    assert layer["wire"] == pytest.approx(32 * 8 * 6144 * 3 * 7 / 8)


def test_markdown_and_out_file(capsys, tmp_path):
    out_file = tmp_path / "ledger.md"
    rc, out, _ = _run(capsys, "--markdown", "--sections", "pd_transfer", "--out", str(out_file))
    assert rc == 0 and out == ""
    assert out_file.read_text().startswith("# dsaserve ledger: glm-5.3")


def test_gpus_past_whole_replicas_are_warned_about(capsys):
    rc, out, _ = _run(capsys, "--tp", "8", "--gpus", "12", "--json", "--sections", "kv_capacity")
    (w,) = [w for w in json.loads(out)["warnings"] if w["code"] == "gpus_past_whole_replicas"]
    assert rc == 0 and w["idle_gpus"] == 4 and "--gpus 12 is not a multiple of a replica's 8 GPUs" in w["message"]
    rc, out, _ = _run(capsys, "--tp", "8", "--gpus", "16", "--json", "--sections", "kv_capacity")
    assert not [w for w in json.loads(out)["warnings"] if w["code"] == "gpus_past_whole_replicas"]


@pytest.mark.parametrize("argv, message", [
    (["--ep", "3"], "--ep 3: n_routed_experts 256 is not divisible by 3"),
    (["--context", "lots"], "--context: 'lots' is not a token count"),
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static: must be in (0, 1]"),
    (["--assume", "warp_speed=9"], "--assume warp_speed: unknown assumption"),
    (["--assume", "indexer_q_tile=many"], "--assume indexer_q_tile: 'many' is not a int"),
    (["--assume", "comm_basis=magic"], "--assume comm_basis: 'magic' not one of wire, message"),
    (["--model", "no-such-model"], "model: 'no-such-model' is neither"),
    (["--tp", "0"], "--tp: must be a positive integer"),
    (["--tp", "3"], "--tp 3: num_attention_heads 64 is not divisible by 3"),
    (["--tp", "3", "--dp-attention"], "--tp 3 --ep 1: moe_intermediate_size 2048 is not divisible by 3"),
    (["--hbm-gb", "-1"], "--hbm-gb: must be a positive number, got -1\n"),
    (["--hbm-tbs", "nan"], "--hbm-tbs: must be a positive number, got nan"),
    (["--nvlink-overhead-us", "-2"], "--nvlink-overhead-us: must be a number >= 0, got -2"),
    (["--assume", "indexer_q_tile=-1"], "--assume indexer_q_tile: must be >= 1, got -1"),
    (["--assume", "mem_fraction_static=2"], "--assume mem_fraction_static: must be in (0, 1], got 2"),
    (["--indexer-q-tile", "0"], "--indexer-q-tile: must be >= 1, got 0"),
    (["--reconcile", "/nonexistent/run.json"], "run file /nonexistent/run.json does not exist"),
    (["--reconcile", "--kv-layout", "nvfp4_ds_mla"], "--kv-layout: the engine's pool has no 'nvfp4_ds_mla'"),
])
def test_bad_input_names_the_flag(capsys, argv, message):
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and message in err


def test_plots_are_written_and_non_empty(capsys, tmp_path):
    rc, _, err = _run(capsys, "--context", "256K", "--chunk", "32K", "--plot", str(tmp_path), "--sections",
                      "prefill_chunks,marginal_vs_context,marginal_vs_batch,kv_capacity_vs_context")
    assert rc == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["kv_capacity_vs_context.png", "marginal_vs_batch.png", "marginal_vs_context.png",
                     "prefill_chunks.png"]
    for p in tmp_path.iterdir():
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert err.count("wrote ") == 4


def test_ledger_never_imports_torch():
    code = ("import sys; from dsaserve.cli import main; "
            "rc = main(['ledger', '--json', '--out', '/dev/null']); "
            "assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("flag, target, message", [
    ("--out", "missing/dir/r.md", "--out: directory {tmp}/missing/dir does not exist"),
    ("--out", ".", "--out: {tmp} is a directory"),
    ("--plot", "afile", "--plot: {tmp}/afile is not a directory"),
    ("--plot", "afile/sub", "--plot: {tmp}/afile is not a directory"),
])
def test_unusable_output_paths_fail_in_one_line_before_any_work(capsys, tmp_path, monkeypatch, flag, target, message):
    from dsaserve.cli import reconcile_driver

    monkeypatch.setattr(reconcile_driver, "run_engine", lambda *a, **k: pytest.fail("the engine ran"))
    (tmp_path / "afile").write_text("x")
    path = str(tmp_path / target) if target != "." else str(tmp_path)
    for argv in ([flag, path, "--sections", "kv_bytes"], ["--reconcile", flag, path]):
        rc, out, err = _run(capsys, *argv)
        assert (rc, out) == (2, "") and err.count("\n") == 1, (argv, err)
        assert f"dsaserve ledger: error: {message.format(tmp=tmp_path)}" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs procfs")
def test_an_output_path_that_fails_only_when_written_is_an_error_not_a_traceback(capsys):
    for flag in ("--out", "--plot"):
        rc, out, err = _run(capsys, flag, "/proc/no-such-dir/x", "--sections", "kv_bytes")
        assert (rc, out) == (2, "") and err.startswith(f"dsaserve ledger: error: {flag}: ") and err.count("\n") == 1


def test_weights_over_the_gpu_memory_warn_in_text_and_json(capsys):
    rc, out, err = _run(capsys, "--tp", "1", "--json", "--sections", "kv_capacity")
    assert rc == 0 and "dsaserve ledger: warning: weights per GPU" in err  # an impossible plan is allowed; it says so
    d = json.loads(out)
    rows = {r["quantity"]: r["value"] for r in d["sections"]["kv_capacity"]["rows"]}
    (w,) = d["warnings"]
    assert w["code"] == "weights_exceed_gpu_memory"
    assert w["excess_bytes"] == pytest.approx(rows["weights per GPU"] - rows["device memory"])
    assert rows["KV pool per GPU"] == 0 and f"by {w['excess_bytes'] / 1e9:.1f} GB" in w["message"]
    rc, out, _ = _run(capsys, "--tp", "1", "--sections", "kv_capacity")
    warning = [line for line in out.splitlines() if line.startswith("warning")]
    assert rc == 0 and len(warning) == 1 and "exceed the GPU's memory" in warning[0]
    rc, out, _ = _run(capsys, "--tp", "1", "--markdown", "--sections", "kv_capacity")
    assert rc == 0 and "exceed the GPU's memory" in out


def test_weights_over_the_static_share_warn_and_a_fitting_deployment_does_not(capsys):
    rc, out, _ = _run(capsys, "--mem-fraction-static", "0.5", "--json", "--sections", "kv_bytes")
    (w,) = json.loads(out)["warnings"]
    assert rc == 0 and w["code"] == "weights_exceed_static_share" and "--mem-fraction-static" in w["message"]
    assert w["excess_bytes"] > 0
    rc, out, _ = _run(capsys, "--json", "--sections", "kv_bytes")
    assert rc == 0 and json.loads(out)["warnings"] == []


@pytest.mark.parametrize("argv, message", [
    (["--save-run", "{tmp}/run.json"], "--save-run: only with --reconcile and no RUN.json"),
    (["--reconcile", "{tmp}/old.json", "--save-run", "{tmp}/run.json"], "--save-run: only with --reconcile and no RUN"),
    (["--reconcile", "--save-run", "{tmp}/no/run.json"], "--save-run: directory {tmp}/no does not exist"),
    (["--reconcile", "--save-run", "{tmp}"], "--save-run: {tmp} is a directory"),
    (["--reconcile-model", "glm-5.3-mini"], "--reconcile-model: only with --reconcile and no RUN.json"),
    (["--reconcile", "{tmp}/old.json", "--reconcile-device", "cuda"], "--reconcile-device: only with --reconcile and"),
])
def test_save_run_without_an_engine_run_or_a_place_to_write_is_an_error(capsys, tmp_path, monkeypatch, argv, message):
    from dsaserve.cli import reconcile_driver

    monkeypatch.setattr(reconcile_driver, "run_engine", lambda *a, **k: pytest.fail("the engine ran"))
    rc, out, err = _run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert (rc, out) == (2, "") and f"dsaserve ledger: error: {message.format(tmp=tmp_path)}" in err
    assert not (tmp_path / "run.json").exists()


def test_a_config_files_report_is_named_after_the_file_or_its_checkpoint_directory(capsys, tmp_path, monkeypatch):
    from dsaserve.config import load_config

    text = load_config("glm-5.3-tiny").to_json()
    (tmp_path / "my-model.json").write_text(text)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(text)
    monkeypatch.chdir(tmp_path / "ckpt")
    for model, name in (("my-model.json", "my-model"), ("ckpt/config.json", "ckpt"), ("ckpt", "ckpt")):
        rc, out, _ = _run(capsys, "--model", str(tmp_path / model), "--tp", "1", "--json", "--sections", "kv_bytes")
        assert rc == 0 and json.loads(out)["model"]["name"] == name, model
    rc, out, _ = _run(capsys, "--model", "config.json", "--tp", "1", "--json", "--sections", "kv_bytes")
    assert rc == 0 and json.loads(out)["model"]["name"] == "ckpt"  # the working directory's name, not ""
