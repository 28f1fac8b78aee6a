"""One setting of `dsaserve eval`, measured through the real ModelRunner (no scheduler, no HTTP).

Owns: `Setting` (device, compute dtype, KV layout, checkpoint variant, FP8 activations; or the HF oracle with the
layout's codec, `quality/hf_oracle.py`), opening its runner with the FP8-activation switch overridden for the runner's
whole life (the kernel registry reads it per forward; `envs.override`, so os.environ is never written),
prefill perplexity over held-out windows (each window's logits at every position, the KV written and
read back in the setting's layout, as a real prefill does), MTP acceptance on the same text, and batched
greedy decode (prefill, then one token per request per step: the decode path reading the paged cache).
CUDA graphs are off unless a setting asks for them (`graphs`: greedy through `ModelRunner.forward`, the decode
graphs serving replays, --batch prompts a step, each step's route counted), since what runs only inside a capture
(the cuBLASLt choices, `kernels/cublaslt_tuning.py`) is numerics an eager run never sees; its eager reference
decodes the same --batch prompts a step (`chunked`: a step's rows choose kernels too).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dsaserve.common import envs
from dsaserve.engine.kv_pool import PAGE_SIZE
from dsaserve.kernels import cublaslt_tuning
from dsaserve.model.forward_batch import ForwardBatch, contiguous_batch


@dataclass(frozen=True)
class Setting:
    name: str
    device: str = "cpu"
    kv_layout: str = "fp8_ds_mla"
    variant: str = "base"  # see quality/variants.py
    fp8_act: bool = True  # GPU only: DSASERVE_FP8_ACTIVATIONS
    hf: bool = False  # HF transformers (float32, CPU) with this KV layout's codec instead of the engine
    dtype: str = "auto"  # compute dtype (EngineArgs.dtype): auto = bfloat16 on cuda, float32 on the CPU
    fp32_head: bool = False  # DSASERVE_FP32_LM_HEAD: float32 logits from a bf16 model
    chunked: bool = False  # greedy decodes --batch prompts a step (else all at once)
    graphs: bool = False  # GPU, chunked: greedy decode replays the CUDA graphs (perplexity stays eager)
    gemm_tuning: bool = True  # with graphs: the cuBLASLt choices (DSASERVE_GEMM_TUNING permitting), else torch's

    def describe(self) -> str:
        if self.hf:
            return f"HF transformers float32 (cpu), kv {self.kv_layout} codec"
        act = "" if self.device == "cpu" else f", fp8 act {'on' if self.fp8_act else 'off'}"
        dtype = "" if self.dtype == "auto" else f" {self.dtype}"
        head = ", fp32 lm_head" if self.fp32_head else ""
        graphs = (", greedy in CUDA graphs" + ("" if self.gemm_tuning else " on torch's cuBLAS choices")
                  if self.graphs else ", greedy --batch a step" if self.chunked else "")
        return f"{self.device}{dtype}, kv {self.kv_layout}, {self.variant}{act}{head}{graphs}"


def open_runner(model_dir: str, s: Setting, max_tokens: int):
    """A ModelRunner for the setting, with a pool for max_tokens tokens (contiguous per request)."""
    from dsaserve.engine.model_runner import ModelRunner

    pages = -(-max_tokens // PAGE_SIZE) + 2
    return ModelRunner.from_kwargs(str(model_dir), device=s.device, dtype=s.dtype, kv_layout=s.kv_layout,
                                   num_pages=pages, load_mtp=True, disable_cuda_graph=not s.graphs,
                                   max_num_batched_tokens=max(max_tokens, 2048))


def page_bases(lengths: list[int]) -> list[int]:
    """Page-aligned slot bases, one contiguous range per request."""
    out, at = [], 0
    for n in lengths:
        out.append(at)
        at += -(-n // PAGE_SIZE) * PAGE_SIZE
    return out


@torch.no_grad()
def perplexity(runner, wins: list[list[int]], batch: int) -> dict:
    """Mean next-token loss over the windows; MTP top-1 accuracy (token t+2) and greedy acceptance (MTP's
    argmax at t equals the main model's argmax at t+1, the token it drafts for)."""
    nll = n = acc = accept = n_mtp = 0.0
    mtp_error = None
    for i in range(0, len(wins), batch):
        chunk = wins[i:i + batch]
        bases = page_bases([len(w) for w in chunk])
        b = contiguous_batch(chunk, [0] * len(chunk), bases)
        b.logits_indices = torch.arange(b.num_tokens)
        b = b.to(runner.device)
        logits, hidden = runner.model(b, runner.kv_pool)
        logp = torch.log_softmax(logits.float(), -1)
        mb = contiguous_batch([w[1:] for w in chunk], [0] * len(chunk), bases)
        mb.logits_indices = torch.arange(mb.num_tokens)
        keep = torch.cat([torch.arange(o, o + len(w) - 1) for o, w in zip(_offsets(chunk), chunk, strict=True)])
        mtp = None
        if runner.model.with_mtp and min(map(len, chunk)) > 2 and mtp_error is None:
            try:  # the MTP columns are extra: a failure there must not cost the perplexity
                mtp = runner.model.forward_mtp(mb.to(runner.device), runner.kv_pool, hidden[keep.to(hidden.device)])
            except Exception as e:  # noqa: BLE001
                mtp_error = f"{type(e).__name__}: {e}"[:500]
        for r, (o, w) in enumerate(zip(_offsets(chunk), chunk, strict=True)):
            tgt = torch.tensor(w[1:], device=logp.device)
            nll -= float(logp[o:o + len(w) - 1].gather(1, tgt[:, None]).sum())
            n += len(w) - 1
            if mtp is not None and len(w) > 2:
                m = mtp[o - r:o - r + len(w) - 2].argmax(-1)  # MTP rows: w[1:] of each window, packed
                acc += float((m == tgt[1:]).sum())
                accept += float((m == logits[o + 1:o + len(w) - 1].argmax(-1)).sum())
                n_mtp += len(w) - 2
    loss = nll / max(n, 1)
    out = {"loss": round(loss, 5), "ppl": round(math.exp(loss), 4), "tokens": int(n)}
    if n_mtp:
        out.update(mtp_acc=round(acc / n_mtp, 4), mtp_accept=round(accept / n_mtp, 4))
    if mtp_error:
        out["mtp_error"] = mtp_error
    return out


def _offsets(chunk: list[list[int]]) -> list[int]:
    out, at = [], 0
    for w in chunk:
        out.append(at)
        at += len(w)
    return out


def _eager_step(runner) -> Callable[[ForwardBatch], torch.Tensor]:
    """The model's eager forward: a batch's logits at its logits_indices."""
    return lambda b: runner.model(b.to(runner.device), runner.kv_pool)[0]


def _replay_step(runner, routes: Counter) -> Callable[[ForwardBatch], torch.Tensor]:
    """`runner.forward` (a decode step replays its graph), each step's route counted."""
    def run(b: ForwardBatch) -> torch.Tensor:
        routes[runner.route(b)] += 1
        return runner.forward(b)
    return run


@torch.no_grad()
def greedy(runner, prompts: list[list[int]], n: int, run: Callable[[ForwardBatch], torch.Tensor] | None = None
           ) -> tuple[list[list[int]], list[list[float]]]:
    """n greedy tokens per prompt (EOS ignored), all prompts batched; also each step's top-1 margin (nats).
    run: a batch's logits (default the model's eager forward; `runner.forward` replays the graphs)."""
    run = run or _eager_step(runner)
    bases = page_bases([len(p) + n for p in prompts])
    logits = run(contiguous_batch(prompts, [0] * len(prompts), bases))
    toks: list[list[int]] = [[] for _ in prompts]
    margins: list[list[float]] = [[] for _ in prompts]
    lens = [len(p) for p in prompts]
    for step in range(n):
        top = torch.log_softmax(logits.float(), -1).topk(2, dim=-1)
        for r in range(len(prompts)):
            toks[r].append(int(top.indices[r, 0]))
            margins[r].append(float(top.values[r, 0] - top.values[r, 1]))
        if step == n - 1:
            break
        b = contiguous_batch([[t[-1]] for t in toks], lens, bases)
        lens = [x + 1 for x in lens]
        logits = run(b)
    return toks, margins


def greedy_chunked(runner, prompts: list[list[int]], n: int, rows: int, graphs: bool
                   ) -> tuple[list[list[int]], list[list[float]], dict]:
    """`greedy`, `rows` prompts at a time, eagerly or through `runner.forward`; what the graphs ran: each step's
    route, the capture errors and the cuBLASLt timing's report."""
    toks: list[list[int]] = []
    margins: list[list[float]] = []
    routes: Counter = Counter()
    for i in range(0, len(prompts), rows):
        t, m = greedy(runner, prompts[i:i + rows], n, _replay_step(runner, routes) if graphs else None)
        toks.extend(t)
        margins.extend(m)
    if not graphs:
        return toks, margins, {}
    tuning = runner.gemm_tuning or {}
    return toks, margins, {"routes": dict(routes), "graph_errors": dict(runner.graph_errors),
                           "gemm_tuning": {k: tuning[k] for k in ("chosen", "error") if k in tuning}}


def _graphs_warning(s: Setting, prompts: int, n: int, rows: int, seen: dict) -> str | None:
    """Why a graphs setting's tokens may not be the graphs' (decode steps that ran eagerly, a failed capture, no
    cuBLASLt choice where one was meant)."""
    decode_steps = -(-prompts // rows) * (n - 1)
    problems = []
    if seen["routes"].get("decode_graph", 0) < decode_steps:
        problems.append(f"{decode_steps - seen['routes'].get('decode_graph', 0)} of {decode_steps} decode steps "
                        f"did not replay a graph (routes {seen['routes']})")
    if seen["graph_errors"]:
        problems.append(f"capture errors {seen['graph_errors']}")
    if s.gemm_tuning and cublaslt_tuning.TUNED and not seen["gemm_tuning"].get("chosen"):
        problems.append(f"no cuBLASLt choice was made ({seen['gemm_tuning']})")
    return "; ".join(problems) or None


def run_setting(model_dir: str, s: Setting, wins: list[list[int]], prompts: list[list[int]], n_tokens: int,
                batch: int) -> dict:
    """Perplexity and greedy tokens of one setting."""
    if s.hf:
        from dsaserve.quality.hf_oracle import run_oracle

        return {"setting": s.name, "describe": s.describe(),
                **run_oracle(model_dir, s.kv_layout, wins, prompts, n_tokens, batch)}
    longest = max([len(w) for w in wins[:batch]] + [0])
    need = max(batch * (longest + PAGE_SIZE), len(prompts) * (max(map(len, prompts), default=0) + n_tokens + PAGE_SIZE))
    tuned = cublaslt_tuning.TUNED
    cublaslt_tuning.TUNED = tuned and s.gemm_tuning  # read at the runner's start and at each capture
    try:
        with envs.override(DSASERVE_FP8_ACTIVATIONS="1" if s.fp8_act else "0",
                           DSASERVE_FP32_LM_HEAD="1" if s.fp32_head else "0"):
            runner = open_runner(model_dir, s, need)
            ppl = perplexity(runner, wins, batch)
            if s.chunked or s.graphs:
                toks, margins, seen = greedy_chunked(runner, prompts, n_tokens, batch, s.graphs)
            else:
                (toks, margins), seen = greedy(runner, prompts, n_tokens), {}
    finally:
        cublaslt_tuning.TUNED = tuned
    del runner
    if s.device == "cuda":
        torch.cuda.empty_cache()
    out = {"setting": s.name, "describe": s.describe(), **ppl, "greedy": toks, "margins": margins}
    if seen:
        out["graphs"] = seen
        warning = _graphs_warning(s, len(prompts), n_tokens, batch, seen)
        if warning:
            out["warning"] = warning
    return out
