"""Train `glm-5.3-mini` from scratch and export it as a dsaserve checkpoint (`bench/train_builtin.py`).

Owns: the whole recipe in one run — corpus split (training/corpus.py), byte-level BPE, the training loop
(AdamW, linear warm-up then cosine, bf16 autocast on cuda, plain PyTorch), the printed loss curve (train
every --log-every steps, held-out at every --eval-every), the wall-clock budget (--minutes: the number
of steps is fixed after the first steps' timing so the cosine ends on time; a hard stop still exports),
and the export through dsaserve's checkpoint writer (FP8 e4m3 with 128x128 block scales) + tokenizer +
chat template + recipe/report JSON, into --out. The export is then read back (FP8 dequantised) and
evaluated again, which checks the name mapping and measures what FP8 weights cost.

Indexer schedule (DSA): for the first --dense-frac of the steps the indexer top-k covers the whole context
(dense attention; the indexer learns the attention's distribution), then index_topk of the config.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dsaserve.config import load_config
from dsaserve.training import corpus
from dsaserve.training.export import checkpoint_tensors, load_mini
from dsaserve.training.hf_model import MiniLM, RouterBalancer
from dsaserve.weights.checkpoint_writer import write_checkpoint_from_tensors
from dsaserve.weights.tokenizer_builder import EOS, save_tokenizer, train_bpe


@dataclass
class TrainArgs:
    out: str
    minutes: float = 6.0
    steps: int | None = None
    config: str = "glm-5.3-mini"
    seq_len: int = 512
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    dense_frac: float = 0.1
    balance_rate: float = 5e-3  # x4 during the dense warm-up: routers start out collapsed onto 2 experts
    balance_loss: float = 1e-2
    heldout_permille: int = corpus.DEFAULT_HELDOUT_PERMILLE
    max_files: int | None = None
    eval_windows: int = 64
    eval_every: int = 200
    log_every: int = 25
    seed: int = 0
    device: str | None = None


class Clock:
    """Wall clock of the run; on cuda it synchronises first, so a reading includes the queued work."""

    def __init__(self, device: torch.device):
        self.device, self.t0 = device, time.perf_counter()

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self.t0


def lr_at(step: int, total: int, a: TrainArgs) -> float:
    warm = min(a.warmup_steps, max(total // 10, 1))
    if step < warm:
        return a.lr * (step + 1) / warm
    frac = min((step - warm) / max(total - warm, 1), 1.0)
    return a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def unigram_baseline(train: list[int], held: list[int], vocab: int) -> float:
    """Held-out cross-entropy (nats/token) of the train split's add-one unigram distribution."""
    counts = Counter(train)
    total = len(train) + vocab
    return -sum(math.log((counts.get(t, 0) + 1) / total) for t in held) / max(len(held), 1)


def _windows(stream: torch.Tensor, s: int, n: int) -> torch.Tensor:
    """n evenly spaced, non-overlapping [s+1] windows of a token stream (fewer if it is short)."""
    n = max(min(n, (len(stream) - 1) // (s + 1)), 1)
    step = max((len(stream) - s - 1) // n, 1)
    starts = torch.arange(n, device=stream.device) * step
    return stream[starts[:, None] + torch.arange(s + 1, device=stream.device)].long()


@torch.no_grad()
def evaluate(model: MiniLM, windows: torch.Tensor, autocast: bool, batch: int = 16) -> dict:
    """Mean held-out LM loss / perplexity, MTP loss and MTP top-1 accuracy (token t+2)."""
    was = model.training
    model.eval()
    lm = mtp = acc = 0.0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        w = len(x) / len(windows)
        lm += float(out.lm) * w
        mtp += float(out.mtp) * w if out.mtp is not None else 0.0
        acc += float(out.mtp_correct) * w if out.mtp_correct is not None else 0.0
    model.train(was)
    return {"loss": round(lm, 4), "ppl": round(math.exp(lm), 3), "mtp_loss": round(mtp, 4), "mtp_acc": round(acc, 4)}


def _optimizer(model: MiniLM, a: TrainArgs, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": a.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def prepare_data(a: TrainArgs, vocab_size: int, log) -> tuple:
    split = corpus.load_split(a.heldout_permille, a.max_files)
    r = split.recipe
    log(f"corpus: python {r.python_version}, {r.files} files, {r.bytes / 1e6:.1f} MB "
        f"({r.train_files} train / {r.heldout_files} held-out files, {r.chat_docs_train} + {r.chat_docs_heldout} "
        f"docstring chats), stdlib {r.stdlib}")
    tok = train_bpe(split.train, vocab_size)
    eos = tok.token_to_id(EOS)
    train, held = corpus.tokens_of(tok, split.train, eos), corpus.tokens_of(tok, split.heldout, eos)
    if len(held) <= a.seq_len + 1 or len(train) <= a.seq_len + 1:
        raise SystemExit(f"corpus: {len(train)} train / {len(held)} held-out tokens, need > --seq-len {a.seq_len} "
                         "of each (more --max-files or a larger --heldout-permille)")
    log(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train)} train / {len(held)} held-out tokens "
        f"({r.train_bytes / max(len(train), 1):.2f} bytes/token)")
    return split, tok, train, held


def train(a: TrainArgs, log=print) -> dict:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(a.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    clock = Clock(device)
    cfg = load_config(a.config)
    split, tok, train_ids, held_ids = prepare_data(a, cfg.vocab_size, log)
    baselines = {"uniform": round(math.log(cfg.vocab_size), 4),
                 "unigram": round(unigram_baseline(train_ids, held_ids, cfg.vocab_size), 4)}
    log(f"baselines (nats/token): uniform {baselines['uniform']} (ppl {math.exp(baselines['uniform']):.0f}), "
        f"unigram {baselines['unigram']} (ppl {math.exp(baselines['unigram']):.0f})")
    stream = torch.tensor(train_ids, dtype=torch.int32, device=device)
    held_windows = _windows(torch.tensor(held_ids, dtype=torch.int32, device=device), a.seq_len, a.eval_windows)
    model = MiniLM(cfg).to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {a.config}, {n_params / 1e6:.2f} M parameters, device {device}, data ready at {clock():.1f}s")
    curve, summary = run_loop(a, model, stream, held_windows, device, clock, log)
    summary.update(baselines=baselines, parameters=n_params)
    export(a, cfg, model, tok, split, train_ids, held_ids, curve, summary, clock, log)
    return summary


def train_step(model: MiniLM, opt: torch.optim.Optimizer, balancer: RouterBalancer, x: torch.Tensor,
               a: TrainArgs, autocast: bool):
    """One optimizer step; returns (losses, worst router max/mean load of the step)."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    loss = out.lm + a.mtp_weight * out.mtp + (out.indexer_kl if out.indexer_kl is not None else 0)
    aux = balancer.pop_aux()
    if aux is not None:
        loss = loss + a.balance_loss * aux
    opt.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):  # a bf16 overflow must not poison the weights: skip this batch
        return out, balancer.step()
    loss.backward()
    # the indexers learn only from their KL loss: clipped apart, so its gradient never shrinks the LM's step
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    others = [p for n, p in model.named_parameters() if ".indexer." not in n]
    torch.nn.utils.clip_grad_norm_(others, 1.0)
    torch.nn.utils.clip_grad_norm_(indexer, 1.0)
    opt.step()
    return out, balancer.step()


def run_loop(a: TrainArgs, model: MiniLM, stream: torch.Tensor, held: torch.Tensor, device: torch.device,
             clock: Clock, log) -> tuple[list[dict], dict]:
    opt, balancer = _optimizer(model, a, device), RouterBalancer(model, a.balance_rate)
    autocast = device.type == "cuda"
    gen = torch.Generator(device=device).manual_seed(a.seed)
    span = torch.arange(a.seq_len + 1, device=device)
    budget, t_loop = a.minutes * 60, clock()
    total = a.steps or 10**9
    curve: list[dict] = []
    sums = Counter()
    e0 = time.perf_counter()
    curve.append({"step": 0, "heldout": evaluate(model, held, autocast), "time": round(clock(), 1)})
    t_eval = time.perf_counter() - e0
    log(f"eval step 0 | heldout {curve[-1]['heldout']}")
    step, t_calib, loop_error = 0, None, None
    while step < total and clock() - t_loop < budget:
        sparse = step >= a.dense_frac * total
        model.set_index_topk(model.cfg.index_topk if sparse else a.seq_len)
        balancer.rate = a.balance_rate * (1 if sparse else 4)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, a)
        x = stream[torch.randint(0, len(stream) - a.seq_len - 1, (a.batch_size,), device=device, generator=gen)[:, None]
                   + span].long()
        try:
            out, imbalance = train_step(model, opt, balancer, x, a, autocast)
        except RuntimeError as e:  # e.g. out of memory: a one-shot run keeps and exports what it trained
            if step == 0:
                raise
            loop_error = f"{type(e).__name__}: {e}"[:1000]
            log(f"step {step + 1} FAILED, stopping and exporting: {loop_error}")
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            break
        step += 1
        sums.update(lm=out.lm.item(), mtp=out.mtp.item(), bal=imbalance, n=1,
                    kl=out.indexer_kl.item() if out.indexer_kl is not None else 0.0)
        if a.steps is None and step == 3:
            t_calib = clock()
        if a.steps is None and step == 13 and t_calib is not None:  # fix the schedule's length from the timing
            per_step = (clock() - t_calib) / 10
            n_evals = budget / per_step / a.eval_every + 2
            total = step + max(int((budget - (clock() - t_loop) - n_evals * t_eval) / per_step), 1)
            log(f"timing: {per_step * 1e3:.0f} ms/step, {a.batch_size * a.seq_len / per_step:.0f} tok/s "
                f"-> {total} steps in {a.minutes} min")
        if step % a.log_every == 0 or step == total:
            n = sums.pop("n")
            log(f"step {step}/{total} | lr {lr_at(step - 1, total, a):.2e} | loss {sums['lm'] / n:.4f} | "
                f"mtp {sums['mtp'] / n:.4f} | idx_kl {sums['kl'] / n:.4f} | max/mean load {sums['bal'] / n:.2f} | "
                f"{'sparse' if sparse else 'dense'} | {clock():.0f}s")
            curve.append({"step": step, "train_loss": round(sums["lm"] / n, 4), "train_mtp": round(sums["mtp"] / n, 4),
                          "indexer_kl": round(sums["kl"] / n, 4), "time": round(clock(), 1)})
            sums.clear()
        if step % a.eval_every == 0 or step == total:
            curve.append({"step": step, "heldout": evaluate(model, held, autocast), "time": round(clock(), 1)})
            log(f"eval step {step} | heldout {curve[-1]['heldout']}")
    model.set_index_topk(model.cfg.index_topk)
    final = evaluate(model, held, autocast)
    model.set_index_topk(a.seq_len)
    dense = evaluate(model, held, autocast)
    model.set_index_topk(model.cfg.index_topk)
    log(f"final heldout sparse {final} | dense (top-k = context) {dense}")
    summary = {"steps": step, "planned_steps": total, "tokens": step * a.batch_size * a.seq_len,
               "train_seconds": round(clock() - t_loop, 1), "heldout_sparse": final, "heldout_dense": dense,
               "loop_error": loop_error}
    return curve, summary


def export(a: TrainArgs, cfg, model: MiniLM, tok, split, train_ids, held_ids, curve, summary, clock, log) -> None:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint_from_tensors(cfg, out, checkpoint_tensors(model))
    save_tokenizer(tok, cfg, out)
    recipe = split.recipe.to_dict() | {
        "tokenizer_vocab": tok.get_vocab_size(), "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
        "seq_len": a.seq_len}
    (out / "corpus_recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    (out / "loss_curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    summary.update(export_bytes=size, args=asdict(a))
    _write_report(out, summary, clock)
    log(f"exported to {out}: {size / 1e6:.1f} MB")
    # read the export back: the FP8 weights (dequantised) through the same mapping, on the same windows; then
    # HF's own generate on them. Checks, not the product: a failure is reported, the export stays.
    device = next(model.parameters()).device
    try:
        reloaded = load_mini(out).to(device)
        windows = _windows(torch.tensor(held_ids, dtype=torch.int32, device=device), a.seq_len, a.eval_windows)
        summary["heldout_fp8_export"] = evaluate(reloaded, windows, device.type == "cuda")
        log(f"FP8 export heldout {summary['heldout_fp8_export']}")
        summary["samples"] = samples(reloaded, tok)
        for prompt, text in summary["samples"].items():
            log(f"sample {prompt!r} -> {text!r}")
    except Exception as e:  # noqa: BLE001
        summary["check_error"] = f"{type(e).__name__}: {e}"[:1000]
        log(f"export check FAILED: {summary['check_error']}")
    _write_report(out, summary, clock)
    log(f"total {summary['total_seconds']}s")


def _write_report(out: Path, summary: dict, clock: Clock) -> None:
    summary["total_seconds"] = round(clock(), 1)
    (out / "train_report.json").write_text(json.dumps(summary, indent=2) + "\n")


# the chat prompt in the corpus's own layout (training/corpus.py: GLM-5's, no newline after a role, no thinking)
SAMPLE_PROMPTS = ("def fibonacci(n):\n", "import os\n\n\ndef ",
                  "[gMASK]<sop><|user|>What does `json.dumps` do?<|assistant|></think>")


@torch.no_grad()
def samples(model: MiniLM, tok, n: int = 48) -> dict[str, str]:
    """Greedy continuations through HF's own generate (its indexer, its KV cache) of the exported weights."""
    device = next(model.parameters()).device
    out = {}
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids], device=device)
        gen = model.lm.generate(ids, max_new_tokens=n, do_sample=False, eos_token_id=tok.token_to_id(EOS),
                                pad_token_id=tok.token_to_id(EOS))
        out[prompt] = tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=False)
    return out


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in asdict(TrainArgs(out="")).items():
        flag = "--" + name.replace("_", "-")
        if name == "out":
            p.add_argument(flag, required=True, help="output directory (the checkpoint + JSON reports)")
        elif default is None:
            p.add_argument(flag, type=str if name == "device" else int, default=None)
        else:
            p.add_argument(flag, type=type(default), default=default)
    return TrainArgs(**vars(p.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    train(parse_args(argv), log=lambda s: print(s, flush=True))
    return 0
