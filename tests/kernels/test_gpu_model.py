"""The whole model on the GPU kernels against the CPU reference: the built-in glm-5.3-mini (kv_lora 256, rope 32,
indexer 16 x 64, top-64, 8 experts), the shapes the kernels were not written for, through a prefill and a few
decode steps. On a GPU the registry binds the kernels (bf16, FP8 weights kept); on the CPU, with the Triton
interpreter (gpu_common.py), `registry.interpreted_gpu_ops` binds them to the CPU: the best proxy for "mini runs
on the GPU" that a machine without one has. The reference runs fp32 on dequantised weights, both with the
fp8_ds_mla KV layout; the GPU side is fed the reference's tokens, so every step compares the same inputs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dsaserve.common import index_pages
from dsaserve.common.kv_layout import decode_index_k, get_kv_layout
from dsaserve.config import load_config
from dsaserve.engine.kv_pool import KVPool
from dsaserve.kernels import reference as R
from dsaserve.kernels import registry
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.weights.checkpoint_cache import packaged_checkpoint
from dsaserve.weights.loader import load_checkpoint
from tests.kernels.gpu_common import BF16, DEVICE, ENC_BYTES, FP8A, rel, requires_gpu_kernels

CKPT = packaged_checkpoint("glm-5.3-mini")
pytestmark = [requires_gpu_kernels,
              pytest.mark.skipif(CKPT is None, reason="dsaserve/builtin/glm-5.3-mini is not in this checkout")]
PAGE = 64
# request A is longer than index_topk (64), so the indexer really selects, and is prefilled in two chunks (the
# second extends a cached prefix); B is shorter than the top-k (every key). The interpreter keeps every chunk
# <= 64 tokens (the skinny GEMMs; its FP8 tiles cost ~1 s per prefill-size GEMM), a GPU takes a long one too.
LEN_A = 300 if DEVICE == "cuda" else 80
PROMPT_A = [(7 * i + 3) % 5000 + 100 for i in range(LEN_A)]
PROMPT_B = [(11 * i + 5) % 5000 + 100 for i in range(20)]
BASES = [0, (LEN_A // PAGE + 2) * PAGE]
DECODE_STEPS = 2
UNCHECKED = ("count_distinct", "dequant_fp8_weight", "apply_rope")  # a device counter; not on the forward path


def _load(device: str, dtype: torch.dtype, keep_fp8: bool) -> tuple[DsaForCausalLM, KVPool]:
    cfg = load_config(CKPT)
    with torch.device(device):
        model = DsaForCausalLM(cfg, with_mtp=False)
    load_checkpoint(model, CKPT, progress=False)
    model.finalize(dtype, torch.device(device), keep_fp8)
    pool = KVPool(cfg, BASES[1] // PAGE + 2, "fp8_ds_mla", model.kv_layer_ids, PAGE, dtype, device)
    return model.eval(), pool


def _steps(model: DsaForCausalLM, pool: KVPool, device: str,
           feed: list[list[int]] | None = None) -> tuple[list[torch.Tensor], list[list[int]]]:
    """(logits of each forward, the decode tokens fed): prefill chunk 1 (A's first 40 tokens + B), chunk 2 (the
    rest of A), then the decode steps, each feeding (A, B) the argmax of their last logits, or `feed[step]`."""
    def run(tokens: list[list[int]], prefix: list[int], bases: list[int]) -> torch.Tensor:
        out.append(model(contiguous_batch(tokens, prefix, bases, PAGE).to(device), pool)[0].float().cpu())
        return out[-1]

    out: list[torch.Tensor] = []
    fed: list[list[int]] = []
    last_b = run([PROMPT_A[:40], PROMPT_B], [0, 0], BASES)[1]
    last = torch.stack([run([PROMPT_A[40:]], [40], BASES[:1])[0], last_b])
    lens = [LEN_A, len(PROMPT_B)]
    for step in range(DECODE_STEPS):
        fed.append(feed[step] if feed is not None else last.argmax(-1).tolist())
        last = run([[t] for t in fed[-1]], lens, BASES)
        lens = [n + 1 for n in lens]
    return out, fed


def _gpu_ops_here():
    if DEVICE == "cuda":
        return contextlib.nullcontext(registry.get_ops("cuda"))
    return registry.interpreted_gpu_ops()


def _same_rows(got: torch.Tensor, want: torch.Tensor) -> int:
    """Rows of two slot / expert-id tensors that hold the same set (the GPU's order is by score or unsorted)."""
    return sum(sorted(g.tolist()) == sorted(w.tolist()) for g, w in zip(got, want, strict=True))


def _differ(got, want, bound: float) -> str:
    """'' when got matches the reference's output within bound, else what differs."""
    if isinstance(got, tuple):
        return next((d for g, w in zip(got, want, strict=True) if (d := _differ(g, w, bound))), "")
    if got.dtype == torch.uint8:  # KV rows: rounding ties may flip a byte
        frac = float((got != want).float().mean())
        return f"{frac:.4f} of the bytes" if frac > ENC_BYTES else ""
    if not got.is_floating_point():  # slots / expert ids, one set per row (a near-tie may differ in one row)
        same = _same_rows(got, want)
        return f"{len(got) - same} rows select other sets" if same < len(got) - 1 else ""
    err = rel(got, want)
    return f"rel {err:.4f}" if not err < bound else ""


def _kv_rows_differ(got: torch.Tensor, want: torch.Tensor, decode, max_frac: float = 0.15) -> str:
    """'' when every written KV row decodes (`decode`) to the reference's within one step of its encoding.
    mla_kv_write normalises in fp32 and encodes once; the reference rounds RMSNorm's output to bf16 and scales
    it in bf16 first, so ~5 % of e4m3 bytes land one step apart (measured on the H200 for the mini's 256-wide
    latent). indexer_k_norm_write's LayerNorm is not torch's CUDA one bit for bit, and a key has one scale (its
    amax / 448): a key whose amax moved re-quantises all its values, so any number of them may differ
    (`max_frac` 1; on the H200 16-33 % of a 512-token prefill's values, none beyond one step). A wrong row
    (position, norm, RoPE) is many steps off."""
    rows = (got != want).any(1).nonzero().flatten()
    if rows.numel() == 0:
        return ""
    g, w = decode(got[rows]).float(), decode(want[rows]).float()
    # one e4m3 step is <= 2^-3 of the value; the absolute term is the reference's bf16 RoPE: it rounds x1 cos
    # and x2 sin before subtracting, so a cancelling pair keeps up to 2^-8 of its terms (H200: 0.0107 against
    # an exact 0 in a row of amax 7.7, rope column 279 of 288)
    over = (g - w).abs() > 2 ** -3 * torch.maximum(g.abs(), w.abs()) + 2 ** -8 * w.abs().amax(1, keepdim=True)
    frac = float((g != w).float().mean())
    if not over.any() and frac <= max_frac:
        return ""
    r, c = divmod(int(((g - w).abs() * over).flatten().argmax()), g.shape[1])
    return (f"{int(over.sum())} values beyond one encoding step (worst: row {int(rows[r])} col {c} of "
            f"{g.shape[1]}: {g[r, c]:.6g} vs {w[r, c]:.6g}, row amax {w[r].abs().max():.4g}), {frac:.3f} differ")


def _topk_of_rounded_q(got: torch.Tensor, args: tuple) -> str:
    """'' when every row's selection is the top-k of the scores of q as the FP8 layouts' kernels round it
    (`decode_q`: e4m3 with one scale a head, the prefill kernels' rule): the float q of the reference parts
    near-ties at the k-th from it in many rows (a 260-token prefill of the mini: 92-133 of 260 on the H200)."""
    from tests.kernels.test_gpu_attention import _check_kernel_topk

    try:
        _check_kernel_topk(got, *args[:9], 0)
    except AssertionError as e:
        return f"a selected key below the k-th score of the rounded q ({e})"
    return ""


def _by_expert(route: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route's (weights, ids) with each row ordered by expert id (both sides leave the order unspecified)."""
    ids, order = route[1].sort(-1)
    return route[0].gather(1, order), ids


def _merged(t: torch.Tensor) -> torch.Tensor:
    """A copy of t with the values it stands for: a sparse MLA output whose split partials W_uv's GEMM merges
    (`triton_sparse_mla.attach_splits`) merged here, apart."""
    from dsaserve.kernels import triton_sparse_mla as S

    pending = S.pending_splits(t)
    if pending is None:
        return t.clone()
    merged = torch.empty_like(t)
    S.combine_splits(*pending, merged)
    return merged


def _checked(name: str, fn, bound: float, failures: list[str]):
    """`fn` that also runs the reference op on copies of the same inputs and records where they part."""
    ref = getattr(R, name)

    def run(*args, **kw):
        copies = [_merged(a) if isinstance(a, torch.Tensor) else a for a in args]
        want = ref(*copies, **kw)
        out = got = fn(*args, **kw)
        if name == "sparse_mla_attention":
            got = _merged(got)
        if name == "moe_route":
            got, want = _by_expert(got), _by_expert(want)
        written = [(a, c) for a, c in zip(args, copies, strict=True)  # in place: RoPE'd x, KV rows
                   if isinstance(a, torch.Tensor) and (a.is_floating_point() or a.dtype == torch.uint8)]
        for g, w in ([(got, want)] if got is not None else []) + written:
            if name == "mla_kv_write" and g is args[0]:
                why = _kv_rows_differ(g, w, lambda rows: args[1].decode_latent(rows, args[8]))  # kv_lora_rank
            elif name == "indexer_k_norm_write" and g is args[0]:
                d = args[3].shape[-1]  # k_raw's head dim; the cache's pages as codec rows of every slot
                every = torch.arange(g.shape[0] * index_pages.page_size_of(g, args[1], d), device=g.device)
                why = _kv_rows_differ(index_pages.read_rows(g, every, args[1], d),
                                      index_pages.read_rows(w, every, args[1], d),
                                      lambda rows: decode_index_k(rows, args[1]), max_frac=1.0)
            elif name == "indexer_topk" and g is got and args[0] is None:  # no queries: every key, in order
                why = "" if torch.equal(got, want) else "the every-key selection differs from the reference's"
            elif name == "indexer_topk" and not get_kv_layout(args[3]).plain_dtype and g is got:
                why = _topk_of_rounded_q(got, args)
            else:
                why = _differ(g, w, bound)
            if why:
                failures.append(f"{name} {tuple(getattr(args[0], 'shape', ()))}: {why}")
        return out

    return run


@pytest.mark.parametrize("fp8_act", ["1", "0"])
def test_mini_forward_on_the_gpu_kernels_matches_the_reference(set_switch, fp8_act):
    """Each kernel against its reference on the same inputs, op by op through the forward (tight bounds: a shape
    the kernel gets wrong shows at once), and the logits against the fp32 reference's (loose: a routing near-tie
    - 8 experts, top-2 - moved one decode row's logits by 8 % with every op within bf16 rounding)."""
    if fp8_act == "0" and DEVICE != "cuda":
        pytest.skip("~4 min in the interpreter; the bf16-activation kernels are tested one by one")
    ref_model, ref_pool = _load("cpu", torch.float32, keep_fp8=False)
    ref, fed = _steps(ref_model, ref_pool, "cpu")
    set_switch("DSASERVE_FP8_ACTIVATIONS", fp8_act)
    failures: list[str] = []
    with _gpu_ops_here() as ops:
        checked = {name: getattr(ops, name) for name in registry.OPS if name not in UNCHECKED}
        for name, fn in checked.items():
            bound = FP8A if name in ("fp8_linear", "fused_moe") and fp8_act == "1" else BF16
            setattr(ops, name, _checked(name, fn, bound, failures))
        try:
            model, pool = _load(DEVICE, torch.bfloat16, keep_fp8=True)
            got, _ = _steps(model, pool, DEVICE, fed)
        finally:
            for name, fn in checked.items():
                setattr(ops, name, fn)
    assert not failures, failures[:10]
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert torch.isfinite(g).all(), f"forward {step}: non-finite logits"
        assert rel(g, r) < 0.15, f"forward {step}: logits {rel(g, r):.4f} from the reference's"
    rows = sum(len(r) for r in ref)
    top1 = sum(int(g.argmax(-1).eq(r.argmax(-1)).sum()) for g, r in zip(got, ref, strict=True))
    assert top1 >= rows - 1, f"{top1} of {rows} greedy tokens agree"


def test_mini_decode_merges_sparse_mlas_splits_in_w_uv(monkeypatch):
    """The mini's top-64 never splits by itself: with 2 splits a call, its 2-token decode steps leave their partials
    to W_uv's head GEMM (`defer_combine`), which merges them; the logits equal those of the combine launch."""
    from dsaserve.kernels import triton_head_gemm as HG
    from dsaserve.kernels import triton_sparse_mla as S

    monkeypatch.setattr(S, "pick_splits", lambda *a: 2)
    folds = []
    pending = HG.pending_splits
    monkeypatch.setattr(HG, "pending_splits", lambda x: folds.append(p := pending(x)) or p)
    runs = {}
    with _gpu_ops_here():
        model, pool = _load(DEVICE, torch.bfloat16, keep_fp8=True)
        for fold_max in (S.FOLD_MAX_T, 0):
            monkeypatch.setattr(S, "FOLD_MAX_T", fold_max)
            folds.clear()
            runs[fold_max] = _steps(model, pool, DEVICE, [[101, 202]] * DECODE_STEPS)[0]
            merged = sum(f is not None for f in folds)
            assert merged == (DECODE_STEPS * len(model.kv_layer_ids) if fold_max else 0), merged
    for g, w in zip(runs[S.FOLD_MAX_T], runs[0], strict=True):
        assert rel(g, w) < 1e-3


def test_mini_batch_within_the_top_k_skips_the_indexer_queries(monkeypatch):
    """Requests within the top-64 take every key: with the indexer's queries skipped (`StepContext.all_keys`) no
    wq_b runs, and the logits are bit for bit those of the path that computes them (both select by `take_all`)."""
    from dsaserve.model.layers import indexer as IX

    runs, calls = {}, []
    with _gpu_ops_here():
        for skip in (True, False):
            monkeypatch.setattr(IX, "SKIP_QUERIES_FOR_ALL_KEYS", skip)
            model, pool = _load(DEVICE, torch.bfloat16, keep_fp8=True)
            for layer in model.model.layers:
                if layer.self_attn.indexer is not None:
                    layer.self_attn.indexer.wq_b.register_forward_hook(lambda *_, s=skip: calls.append(s))
            steps = [([PROMPT_B, PROMPT_B[:7]], [0, 0]), ([[101], [202]], [20, 7]), ([[303], [404]], [21, 8])]
            runs[skip] = [model(contiguous_batch(t, p, BASES, PAGE).to(DEVICE), pool)[0] for t, p in steps]
    assert True not in calls and False in calls
    for got, want in zip(runs[True], runs[False], strict=True):
        assert torch.equal(got, want)
