"""bench/sweep_sparse_mla_swap.py's verdict (the GPU parts run on the device): best per case, the overall winner and
whether to flip registry.SPARSE_MLA_SWAP_AB, from timing rows and reference errors."""

from __future__ import annotations

from bench import sweep_sparse_mla_swap as S


def _rows(tflops: dict[str, float]) -> list[dict]:
    return [{"case": case, "config": name, "TFLOPs": tf * (1 + 0.01 * i), "vs_flashmla": 0.0, "vs_bf16_peak": 0.0}
            for i, case in enumerate(S.CASES) for name, tf in tflops.items()]


def test_summary_flips_when_a_correct_config_wins_every_case():
    rows = _rows({S.OLD: 100.0, "default": 200.0, "lazy": 150.0})
    out = S.summary(rows, {"default fp8_ds_mla T=20": 1e-3, "lazy fp8_ds_mla T=20": 1e-3})
    assert out["flip"] and out["winner"] == "default"
    assert all(b["config"] == "default" for b in out["best"].values())
    assert all(abs(g - 2.0) < 1e-9 for g in out["gain_vs_split_k"].values())


def test_summary_ignores_a_wrong_config_and_does_not_flip_on_a_wrong_default():
    rows = _rows({S.OLD: 100.0, "default": 300.0, "lazy": 150.0})
    out = S.summary(rows, {"default bf16 T=300": 0.3, "lazy fp8_ds_mla T=20": 1e-3})
    assert out["failed_checks"] == ["default"] and out["winner"] == "lazy"
    assert not out["flip"]  # lazy wins, but only "default" was checked on the other layouts, and it failed


def test_summary_does_not_flip_when_the_split_k_kernel_wins_a_case():
    rows = _rows({S.OLD: 100.0, "default": 200.0})
    rows[-1]["TFLOPs"] = 90.0  # the last case's swap row (rows of a case: OLD, default)
    out = S.summary(rows, {"default fp8_ds_mla T=20": 1e-3})
    assert not out["flip"]


def test_configs_are_known_overrides_of_the_kernels_default():
    from dsaserve.kernels.triton_sparse_mla_swap import DEFAULT

    swap = {n: c for n, c in S.CONFIGS.items() if n not in S.SPLIT_K}
    assert "default" in swap and all(set(c) <= set(DEFAULT) for c in swap.values())
    # the split-K configs override what sparse_mla_attention's `config` takes
    known = {"block_h", "block_k", "num_warps", "num_stages", "splits", "grouped", "prefetch"}
    assert all(set(c) <= known for c in S.SPLIT_K.values())


def test_split_k_configs_are_summarised_apart_and_never_flip_the_swap_switch(capsys):
    rows = _rows({S.OLD: 100.0, "default": 90.0, "sk-bk64": 130.0})
    out = S.summary(rows, {})
    assert not out["flip"] and out["winner"] == "default"
    assert "SPLIT-K BEST" in capsys.readouterr().out
