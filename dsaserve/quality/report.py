"""`dsaserve eval`'s comparisons: which settings run, which reference each is compared with, the table.

Owns: the plan (the four KV layouts against fp32; dense attention and every-layer-full indexers against
the base; the CPU path computing in bfloat16 against the float32 reference, and on a GPU FP8 activations off
against on and the GPU base against both CPU references with the same KV layout; each KV layout against HF
transformers whose KV goes through that layout's codec - the fair oracle of a quantised layout,
`quality/hf_oracle.py`), the held-out data (corpus split of the checkpoint's recipe, read from the local Python's
stdlib and tokenised with its tokenizer, and a warning when it is not the split the model was trained on),
agreement metrics (identical continuations, agreeing prefix, and where each parting happens at
what top-1 margins), and the table / JSON (written after every setting, so a run cut short still leaves what
it measured)."""

from __future__ import annotations

import json
import math
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dsaserve.kernels import cublaslt_tuning
from dsaserve.quality.runs import Setting, run_setting
from dsaserve.quality.variants import make_variant
from dsaserve.training import corpus

ALL_GROUPS = ("kv", "sparse", "indexer", "fp8_act", "cpu_ref", "fp32_head", "gpu_fp32", "graphs", "hf")
KV_GROUP = ("fp32", "bf16", "fp8_ds_mla", "fp8_e4m3")  # the engine's layouts; fp32 is the exact reference


@dataclass
class EvalArgs:
    model: str
    device: str = "cpu"
    kv_layout: str = "fp8_ds_mla"  # the base setting's layout (the engine default)
    groups: tuple[str, ...] = ALL_GROUPS
    windows: int = 16
    window_len: int = 512
    batch: int = 4
    prompts: int = 10
    prompt_len: int = 128
    max_tokens: int = 32
    json_path: str | None = None
    max_files: int | None = None


@dataclass
class Plan:
    settings: list[Setting] = field(default_factory=list)
    pairs: list[tuple[str, str, str]] = field(default_factory=list)  # (question, setting, reference)

    def add(self, s: Setting) -> None:
        if all(x.name != s.name for x in self.settings):
            self.settings.append(s)


def make_plan(a: EvalArgs) -> Plan:
    p, dev, gpu = Plan(), a.device, a.device == "cuda"
    base = Setting(f"{dev}:{a.kv_layout}", dev, a.kv_layout)
    p.add(base)
    if "kv" in a.groups:
        ref = Setting(f"{dev}:fp32", dev, "fp32")
        p.add(ref)
        for layout in KV_GROUP[1:]:
            p.add(Setting(f"{dev}:{layout}", dev, layout))
            p.pairs.append((f"KV {layout} vs fp32", f"{dev}:{layout}", ref.name))
    if "hf" in a.groups:  # every layout this plan runs, against HF with that layout's codec (on the CPU)
        for layout in dict.fromkeys((a.kv_layout, *(KV_GROUP if "kv" in a.groups else ()))):
            p.add(Setting(f"hf:{layout}", "cpu", layout, hf=True))
            p.pairs.append((f"KV {layout} vs HF, same codec", f"{dev}:{layout}", f"hf:{layout}"))
    if "sparse" in a.groups:
        p.add(Setting(f"{dev}:{a.kv_layout}:dense", dev, a.kv_layout, "dense"))
        p.pairs.append(("dense (top-k >= context) vs sparse", f"{dev}:{a.kv_layout}:dense", base.name))
    if "indexer" in a.groups:
        p.add(Setting(f"{dev}:{a.kv_layout}:all_full", dev, a.kv_layout, "all_full"))
        p.pairs.append(("every layer full vs shared", f"{dev}:{a.kv_layout}:all_full", base.name))
    if gpu and "fp8_act" in a.groups:
        p.add(Setting(f"{dev}:{a.kv_layout}:bf16act", dev, a.kv_layout, fp8_act=False))
        p.pairs.append(("FP8 activations off vs on", f"{dev}:{a.kv_layout}:bf16act", base.name))
    if "cpu_ref" in a.groups:
        _add_cpu_refs(p, a.kv_layout, base.name if gpu else None)
    if gpu and "fp32_head" in a.groups:  # bf16 logits tie close tokens: does a float32 lm_head output part less?
        head = Setting(f"{dev}:{a.kv_layout}:fp32head", dev, a.kv_layout, fp32_head=True)
        p.add(head)
        p.add(Setting(f"cpu:{a.kv_layout}", "cpu", a.kv_layout))
        p.pairs.append(("GPU fp32 lm_head vs CPU reference", head.name, f"cpu:{a.kv_layout}"))
        p.pairs.append(("GPU fp32 lm_head vs bf16 lm_head", head.name, base.name))
    if gpu and "gpu_fp32" in a.groups:  # the GPU path in the reference's dtype: what is left is kernel order
        f32 = Setting(f"{dev}:{a.kv_layout}:float32", dev, a.kv_layout, dtype="float32", fp8_act=False)
        p.add(f32)
        p.add(Setting(f"cpu:{a.kv_layout}", "cpu", a.kv_layout))
        p.pairs.append(("GPU float32 vs CPU reference", f32.name, f"cpu:{a.kv_layout}"))
    if gpu and "graphs" in a.groups:
        _add_graphs(p, dev, a.kv_layout)
    # most telling first: a run cut short (a time limit) still answers the main questions
    order = [base.name, f"{dev}:fp32", f"cpu:{a.kv_layout}", f"cpu:{a.kv_layout}:bfloat16",
             f"{dev}:{a.kv_layout}:dense", f"{dev}:bf16"]
    p.settings.sort(key=lambda s: order.index(s.name) if s.name in order else len(order))
    return p


def _add_graphs(p: Plan, dev: str, kv_layout: str) -> None:
    """Greedy through the CUDA graphs serving replays against the eager path, both --batch prompts a step, and,
    where the cuBLASLt choices are on, against the same graphs on torch's own cuBLAS choices."""
    graphs = Setting(f"{dev}:{kv_layout}:graphs", dev, kv_layout, graphs=True)
    eager = Setting(f"{dev}:{kv_layout}:chunked", dev, kv_layout, chunked=True)  # the same rows a step, eagerly
    p.add(eager)
    p.add(graphs)
    p.pairs.append(("CUDA graphs vs eager, --batch a step", graphs.name, eager.name))
    if cublaslt_tuning.TUNED:
        torch_gemm = Setting(f"{graphs.name}:torch_gemm", dev, kv_layout, graphs=True, gemm_tuning=False)
        p.add(torch_gemm)
        p.pairs.append(("cuBLASLt choices vs torch's, in the graphs", graphs.name, torch_gemm.name))


def _add_cpu_refs(p: Plan, kv_layout: str, gpu_base: str | None) -> None:
    """The CPU reference (float32) and the CPU path computing in bfloat16, same KV layout: how far bf16
    rounding alone moves greedy; on a GPU, the GPU base against each of them."""
    fp32, bf16 = f"cpu:{kv_layout}", f"cpu:{kv_layout}:bfloat16"
    p.add(Setting(fp32, "cpu", kv_layout))
    p.add(Setting(bf16, "cpu", kv_layout, dtype="bfloat16"))
    if gpu_base:
        p.pairs.append(("GPU vs CPU reference", gpu_base, fp32))
        p.pairs.append(("GPU vs CPU bfloat16", gpu_base, bf16))
    p.pairs.append(("CPU bfloat16 vs float32 compute", bf16, fp32))


def heldout_data(a: EvalArgs) -> tuple[list[list[int]], list[list[int]], dict]:
    """(perplexity windows, greedy prompts, what was read): the checkpoint's held-out split, tokenised."""
    from tokenizers import Tokenizer

    model = Path(a.model)
    recipe_path = model / "corpus_recipe.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    permille = int(recipe.get("heldout_permille", corpus.DEFAULT_HELDOUT_PERMILLE))
    split = corpus.load_split(permille, a.max_files or recipe.get("max_files"), heldout_only=True)
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    stream = corpus.tokens_of(tok, split.heldout, tok.token_to_id("<|endoftext|>"))
    wins = corpus.windows(stream, a.window_len, a.windows + a.prompts)
    if len(wins) < 2:
        raise ValueError(f"held-out split: only {len(stream)} tokens, too few for --window-len {a.window_len}")
    # disjoint: prompts come from the windows perplexity does not use
    ppl_wins, prompt_wins = wins[: max(len(wins) - a.prompts, 1)], wins[max(len(wins) - a.prompts, 1):] or wins[:1]
    info = {"python": split.recipe.python_version, "trained_on_python": recipe.get("python_version"),
            "heldout_files": split.recipe.heldout_files, "heldout_tokens": len(stream),
            "trained_on_heldout_files": recipe.get("heldout_files"),
            "trained_on_heldout_tokens": recipe.get("heldout_tokens"),
            "windows": len(ppl_wins), "window_len": a.window_len, "prompts": len(prompt_wins),
            "prompt_len": a.prompt_len, "max_tokens": a.max_tokens}
    info["split_warning"] = split_warning(info, model.name, a.max_files)
    return ppl_wins, [w[: a.prompt_len] for w in prompt_wins], info


def split_warning(info: dict, model: str, max_files: int | None = None) -> str | None:
    """What to say when the held-out split rebuilt here is not the one the model was trained and measured on:
    the split is read from the local Python's stdlib, so another Python (or --max-files) gives another text
    and another perplexity. Compared by held-out file and token count; by version for a recipe without them."""
    trained_py = info["trained_on_python"]
    if trained_py is None:  # no corpus_recipe.json: nothing to compare with
        return None
    trained = (info["trained_on_heldout_files"], info["trained_on_heldout_tokens"])
    here = (info["heldout_files"], info["heldout_tokens"])
    if (trained_py == info["python"]) if None in trained else (trained == here):
        return None
    read = f"the first {max_files} files of " if max_files else ""
    return (f"the held-out split rebuilt here (Python {info['python']}: {_split_size(*here)}) is not the one "
            f"{model} was trained on (Python {trained_py}: {_split_size(*trained)}); it is read from {read}the "
            f"local Python's standard library, so perplexities differ from its train_report.json's (and the README's): "
            f"run under Python {trained_py} to compare with them")


def _split_size(files: int | None, tokens: int | None) -> str:
    return f"{'?' if files is None else files} held-out files, {'?' if tokens is None else tokens} tokens"


def agreement(a: list[list[int]], b: list[list[int]], margins_a: list[list[float]] | None = None,
              margins_b: list[list[float]] | None = None) -> dict:
    """Identical continuations, the mean number of leading tokens that agree, and each parting: the prompt, the
    step of the first difference and, given the runs' per-step top-1 margins (nats, `runs.greedy`), each run's
    margin at that step. Both runs read the same prefix there, so their logits moved by at least the sum of the
    two margins: small margins are a near-tie flipped by rounding, a large one a wrong computation."""
    prefix, partings = [], []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        k = next((j for j, (u, v) in enumerate(zip(x, y, strict=True)) if u != v), len(x))
        prefix.append(k)
        if k < len(x):
            partings.append({"prompt": i, "step": k, **_parting_margins(i, k, margins_a, margins_b)})
    out = {"identical": sum(k == len(x) for k, x in zip(prefix, a, strict=True)), "of": len(a),
           "mean_prefix": round(sum(prefix) / max(len(prefix), 1), 2), "partings": partings}
    both = [max(p["margin"], p["ref_margin"]) for p in partings if "margin" in p]
    out["max_parting_margin"] = round(max(both), 4) if both else None
    return out


def _parting_margins(i: int, k: int, ma: list[list[float]] | None, mb: list[list[float]] | None) -> dict:
    if ma is None or mb is None:
        return {}
    return {"margin": round(ma[i][k], 4), "ref_margin": round(mb[i][k], 4)}


def compare(results: dict[str, dict], pairs: list[tuple[str, str, str]]) -> list[dict]:
    rows = []
    for question, name, ref in pairs:
        if name not in results or ref not in results:
            continue
        r, q = results[name], results[ref]
        rows.append({"question": question, "setting": name, "reference": ref, "ppl": r["ppl"], "ref_ppl": q["ppl"],
                     "ppl_change_pct": round(100 * (r["ppl"] / q["ppl"] - 1), 3),
                     **agreement(r["greedy"], q["greedy"], r.get("margins"), q.get("margins"))})
    return rows


def table(results: dict[str, dict], rows: list[dict], baselines: dict | None) -> str:
    lines = [f"{'setting':34} {'ppl':>9} {'loss':>8} {'mtp acc':>8} {'mtp accept':>10}"]
    for name, r in results.items():
        lines.append(f"{name:34} {r['ppl']:9.3f} {r['loss']:8.4f} {r.get('mtp_acc', float('nan')):8.3f} "
                     f"{r.get('mtp_accept', float('nan')):10.3f}")
    if baselines:
        lines.append("baselines: " + ", ".join(f"{k} ppl {math.exp(v):.1f}" for k, v in baselines.items()))
    lines.append("")
    lines.append(f"{'question':38} {'ppl':>9} {'ref ppl':>9} {'change':>8} {'greedy identical':>17} {'prefix':>7} "
                 f"{'max parting margin':>19}")
    for r in rows:
        worst = r.get("max_parting_margin")
        lines.append(f"{r['question']:38} {r['ppl']:9.3f} {r['ref_ppl']:9.3f} {r['ppl_change_pct']:+7.2f}% "
                     f"{r['identical']:>9}/{r['of']:<7} {r['mean_prefix']:7.1f} "
                     f"{'-' if worst is None else f'{worst:.3f} nats':>19}")
    partings = [f"  {r['question']}: " + ", ".join(map(_describe, r["partings"])) for r in rows if r.get("partings")]
    if partings:
        lines += ["", "partings (prompt @ step: top-1 margin of the setting / of the reference, nats):", *partings]
    return "\n".join(lines)


def _describe(p: dict) -> str:
    at = f"#{p['prompt']}@{p['step']}"
    return f"{at} {p['margin']:.3f}/{p['ref_margin']:.3f}" if "margin" in p else at


def run_eval(a: EvalArgs, log: Callable[[str], None] = print, warn: Callable[[str], None] | None = None) -> dict:
    """Every setting of the plan on the held-out data; `log` gets progress and the table, `warn` (default: `log`)
    a held-out split unlike the trained one."""
    from dsaserve.weights.checkpoint_cache import resolve_checkpoint

    a.model = str(resolve_checkpoint(a.model))  # a directory, or a built-in name (the packaged glm-5.3-mini)
    wins, prompts, info = heldout_data(a)
    if info["split_warning"]:
        (warn or log)(f"WARNING: {info['split_warning']}")
    plan = make_plan(a)
    report_path = Path(a.model) / "train_report.json"
    baselines = json.loads(report_path.read_text()).get("baselines") if report_path.is_file() else None
    out = {"model": str(a.model), "device": a.device, "data": info, "baselines": baselines, "results": {},
           "comparisons": [], "errors": {}}
    with tempfile.TemporaryDirectory(prefix="dsaserve-eval-") as tmp:
        for s in plan.settings:
            t0 = time.perf_counter()
            context = max(a.window_len, a.prompt_len + a.max_tokens)
            try:
                variant = make_variant(a.model, s.variant, tmp, context)
                r = run_setting(str(variant), s, wins, prompts, a.max_tokens, a.batch)
            except Exception as e:  # one broken setting must not hide the answers of the others
                out["errors"][s.name] = f"{type(e).__name__}: {e}"[:2000]
                log(f"{s.name}: FAILED {out['errors'][s.name]}")
                continue
            r["seconds"] = round(time.perf_counter() - t0, 2)
            out["results"][s.name] = r
            out["comparisons"] = compare(out["results"], plan.pairs)
            log(f"{s.name}: ppl {r['ppl']} ({s.describe()}, {r['seconds']}s)")
            if r.get("warning"):
                log(f"{s.name}: WARNING {r['warning']}")
            if a.json_path:
                Path(a.json_path).write_text(json.dumps(out, indent=1) + "\n")
    log(table(out["results"], out["comparisons"], baselines))
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(out, indent=1) + "\n")
    return out
