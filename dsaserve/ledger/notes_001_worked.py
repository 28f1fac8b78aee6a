"""Note 001's worked decode step ("算例:batch 32、128K 上下文的单步分解") figure by figure.

Owns: the worked step's rows — DP gather / scatter, dispatch + combine, main KV and indexer reads, the
weight read, the LM-head gather, and the shares of the step — each as the ledger computes it under the
note's inputs, and why they differ. The note's example is DP-attention over 8 ranks with b = 32 for the
whole deployment (its communication rows), yet its KV and indexer rows read 32 requests on one GPU: the
ledger's one GPU attends ceil(32/8) = 4, so those rows and the shares differ by the note's own 8x.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from dsaserve.ledger.collective_plan import CollectiveRow, a2a_tokens, row_time, step_plan
from dsaserve.ledger.deployment import Assumptions
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.marginal import DecodeStep, decode_step
from dsaserve.ledger.notes import NOTE_DP_EP8, Figure, NoteContext
from dsaserve.ledger.units import GB, MB, MiB
from dsaserve.ledger.weights import stored_per_gpu

F = partial(Figure, note="001", where="算例:batch 32、128K 上下文的单步分解")
BATCH, CONTEXT = 32, 128 * 1024
# The note's own times (ms) of its table: DP gather/scatter 78 us + 0.8 ms launches, dispatch + combine,
# main KV, indexer, weights, LM-head gather.
NOTE_MS = {"dp": 0.078 + 0.8, "a2a": 0.43, "kv": 0.6, "idx": 2.4, "w": 23.0, "lm": 0.020}


def _msg(rows: list[CollectiveRow]) -> float:
    return sum(r.total_message for r in rows)


def _t(rows: list[CollectiveRow], c: NoteContext, asm: Assumptions) -> float:
    return sum(row_time(r, c.hw, asm) for r in rows)


@dataclass(frozen=True)
class Worked:
    """The worked step under the note's inputs: its collectives (as the note's table counts them) and one GPU."""

    asm: Assumptions
    dp: list[CollectiveRow]  # 78 all-gathers + 78 reduce-scatters
    a2a: list[CollectiveRow]  # dispatch + combine, all 32 tokens' copies (the note's count)
    lm: list[CollectiveRow]
    gpu: DecodeStep  # one GPU: ceil(32/8) requests, its own tokens' dispatch
    times: dict[str, float]  # seconds of one GPU's step, the note's rows (+ its 0.8 ms of launches)

    @property
    def total(self) -> float:
        return sum(self.times.values())

    @property
    def eight(self) -> str:
        """Why the KV / indexer rows and the shares differ: the note's own 8x."""
        req = self.gpu.requests_per_gpu
        return (f"the note's example is DP-attention over 8 ranks and its communication rows take b = {BATCH} for "
                f"the whole deployment (61 MB = 156 x 32 x 6144 x 2 B), so one GPU attends ceil(32/8) = {req} "
                f"requests; the note reads all {BATCH} on one GPU ({BATCH // req}x)")


def worked_step(c: NoteContext) -> Worked:
    asm = replace(c.asm, dp_gather="per_layer")  # the worked example counts 78 gathers + 78 scatters
    plan = step_plan(c.cfg, NOTE_DP_EP8, asm, BATCH, logits_rows=BATCH)
    dp = [r for r in plan if r.kind in ("all_gather", "reduce_scatter") and not r.point.startswith("vocab")]
    a2a = [r for r in plan if r.kind == "all_to_all"]
    lm = [r for r in plan if r.point.startswith("vocab")]
    # one GPU of the deployment: the ledger's own per-rank count of its requests and its dispatched tokens
    gpu = decode_step(c.cfg, c.inv, NOTE_DP_EP8, c.hw, replace(asm, a2a_count="rank"), "fp8_ds_mla", BATCH, CONTEXT)
    times = {"dp": _t(dp, c, asm) + sum(r.calls for r in dp) * 5e-6,  # the note adds 0.8 ms of launches here
             "a2a": gpu.term("moe_a2a").time_s, "kv": gpu.term("kv").time_s, "idx": gpu.term("indexer").time_s,
             "w": gpu.term("weights").time_s, "lm": _t(lm, c, asm)}
    return Worked(asm, dp, a2a, lm, gpu, times)


def figures(c: NoteContext) -> list[Figure]:
    wk = worked_step(c)
    return _comm(c, wk) + _reads(c, wk) + _weights(c, wk) + _shares(wk)


def _comm(c: NoteContext, wk: Worked) -> list[Figure]:
    dp, a2a, asm = wk.dp, wk.a2a, wk.asm
    dflt = decode_step(c.cfg, c.inv, NOTE_DP_EP8, PRESETS["h200"], Assumptions(), "fp8_ds_mla", BATCH, CONTEXT)
    own = a2a_tokens(NOTE_DP_EP8, Assumptions(), BATCH)
    sent = own * c.cfg.num_experts_per_tok * c.cfg.hidden_size * 3 * len(c.cfg.moe_layers)
    mine = dflt.term("moe_a2a")
    rank = (f"one rank sends only its own ceil(32/8) = {own} tokens' copies, 75 x {own} x 8 x 6144 x 3 B = "
            f"{sent / MB:.1f} MB, and 7/8 of it leaves the GPU")
    return [
        F(id="001.worked.dp_bytes", quantity="DP all-gather + reduce-scatter bytes, b=32", note_text="61",
          unit="MB", ledger=_msg(dp)),
        F(id="001.worked.dp_calls", quantity="DP all-gather + reduce-scatter calls", note_text="156",
          unit="", ledger=sum(r.calls for r in dp)),
        F(id="001.worked.dp_time", quantity="DP gather/scatter transfer on NVLink", note_text="78",
          unit="us", ledger=_t(dp, c, asm)),
        F(id="001.worked.dp_launch", quantity="156 calls x 5 us", note_text="0.8", unit="ms",
          ledger=sum(r.calls for r in dp) * 5e-6),
        F(id="001.worked.a2a_bytes", quantity="dispatch + combine bytes, b=32 (every sender summed)",
          note_text="339", unit="MB", ledger=_msg(a2a), default=mine.bytes, default_why=rank,
          reason=f"75 x 32 x 8 x 6144 x (1 + 2) B = {_msg(a2a) / MB:.1f} MB (= {_msg(a2a) / MiB:.1f} MiB); "
                 "339 MB matches the note's 0.43 ms x 787 GB/s, not the product"),
        F(id="001.worked.a2a_calls", quantity="dispatch + combine calls", note_text="150", unit="",
          ledger=sum(r.calls for r in a2a)),
        F(id="001.worked.a2a_time", quantity="dispatch + combine on NVLink", note_text="0.43", unit="ms",
          ledger=_t(a2a, c, asm), reason=f"follows from {_msg(a2a) / MB:.1f} MB (not 339 MB) at 787 GB/s",
          default=mine.time_s, default_why=f"{rank}: {mine.bytes / MB:.1f} MB / 450 GB/s + {mine.calls} x "
                      f"{PRESETS['h200'].nvlink_overhead_s * 1e6:g} us"),
    ]


def _reads(c: NoteContext, wk: Worked) -> list[Figure]:
    sel, kv656, kv576 = c.cfg.index_topk, c.kv().main, c.kv("fp8_e4m3").main
    idx_tok = CONTEXT * c.kv().indexer
    kv, idx, req = wk.gpu.term("kv"), wk.gpu.term("indexer"), wk.gpu.requests_per_gpu
    layout = (f"the note reads {sel} x 576 B x 78 (the fp8_e4m3 layout) while the pool stores 656 B/token/layer "
              f"(fp8_ds_mla): {sel * kv656 / MB:.1f} MB/token; --kv-layout fp8_e4m3 gives {sel * kv576 / MB:.1f} MB")
    scale = "the ledger reads the indexer's FP32 scale with each key (132 B); the note uses 128 B"
    kv_why = f"{wk.eight}: {req} x {sel * kv656 / MB:.1f} MB = {kv.bytes / GB:.3f} GB; per request, {layout}"
    idx_why = f"{wk.eight}: {req} x {idx_tok / MB:.1f} MB = {idx.bytes / GB:.3f} GB; per request, {scale}"
    return [
        F(id="001.worked.kv_per_token", quantity="main KV read per request (top-2048, 78 layers)",
          note_text="92", unit="MB", ledger=sel * kv656, reason=layout),
        F(id="001.worked.kv_step", quantity="main KV read of one GPU's requests", note_text="2.9",
          unit="GB", ledger=kv.bytes, reason=kv_why),
        F(id="001.worked.kv_time", quantity="main KV read time (4.8 TB/s)", note_text="0.6", unit="ms",
          ledger=kv.time_s, reason=f"{wk.eight}: {kv.bytes / GB:.3f} GB / 4.8 TB/s = {kv.time_s * 1e3:.3f} ms "
                                   "(576 vs 656 B per slot: see 001.worked.kv_step)"),
        F(id="001.worked.idx_per_token", quantity="indexer read per request at 128K", note_text="352",
          unit="MB", ledger=idx_tok, reason=scale),
        F(id="001.worked.idx_step", quantity="indexer read of one GPU's requests", note_text="11.3", unit="GB",
          ledger=idx.bytes, reason=idx_why),
        F(id="001.worked.idx_time", quantity="indexer read time", note_text="2.4", unit="ms",
          ledger=idx.time_s, reason=f"{wk.eight}: {idx.bytes / GB:.3f} GB / 4.8 TB/s = {idx.time_s * 1e3:.3f} ms "
                                    "(128 vs 132 B keys: see 001.worked.idx_step)"),
    ]


def _weights(c: NoteContext, wk: Worked) -> list[Figure]:
    stored = stored_per_gpu(c.inv, NOTE_DP_EP8, wk.asm)
    replicated = sum(v for k, v in stored.items() if k not in ("experts", "embed", "lm_head"))
    vocab = c.cfg.vocab_size * c.cfg.hidden_size * 2  # one whole BF16 vocab matrix
    parts = {"attention": stored["attn_a"] + stored["attn_b"] + stored["layer_norms"], "shared experts":
             stored["shared"], "dense MLP": stored["dense_mlp"], "router": stored["router"],
             "indexer": stored["indexer"]}
    listed = " + ".join(f"{k} {v / GB:.2f}" for k, v in parts.items())
    weights = wk.gpu.term("weights").bytes
    dflt = decode_step(c.cfg, c.inv, NOTE_DP_EP8, PRESETS["h200"], Assumptions(), "fp8_ds_mla", BATCH, CONTEXT)
    return [
        F(id="001.worked.replicated", quantity="replicated (non-expert) weights per GPU",
          note_text="18", unit="GB", ledger=replicated,
          reason=f"{listed} GB = {replicated / GB:.2f} GB; no grouping gives 18: with this GPU's "
                 f"{stored['lm_head'] / GB:.2f} GB lm_head shard {(replicated + stored['lm_head']) / GB:.2f} GB, "
                 f"with a whole {vocab / GB:.2f} GB vocab matrix (lm_head unsharded) "
                 f"{replicated / GB:.2f} + {vocab / GB:.2f} = {(replicated + vocab) / GB:.2f} GB"),
        F(id="001.worked.weights", quantity="weights read per GPU per step", note_text="109", unit="GB",
          ledger=weights, reason=f"{stored['experts'] / GB:.1f} GB of experts + {replicated / GB:.1f} GB replicated "
                                 f"+ {stored['lm_head'] / GB:.2f} GB lm_head shard = {weights / GB:.1f} GB; "
                                 "the note rounds both parts up (91 + 18)"),
        F(id="001.worked.weights_time", quantity="weight read time (4.8 TB/s)", note_text="23", unit="ms",
          ledger=wk.times["w"], tol=0.7, default=dflt.term("weights").time_s,
          default_why="the ledger's default expert_routing=uniform: 32 tokens touch 1-(1-8/256)^32 = 64% of "
                      "experts; moe_dense_tp_size=tp splits the dense/shared MLPs"),
        F(id="001.worked.lm_bytes", quantity="LM-head gather (32 x 154,880 x 4 x 7/8)", note_text="17",
          unit="MB", ledger=wk.lm[0].wire_bytes),
        F(id="001.worked.lm_time", quantity="LM-head gather time", note_text="20", unit="us",
          ledger=wk.lm[0].wire_bytes / c.hw.nvlink_bw, tol=5),
    ]


def _shares(wk: Worked) -> list[Figure]:
    t, total = wk.times, wk.total
    own = sum(NOTE_MS.values())
    own_rest = 1 - NOTE_MS["w"] / own
    step = f"a {total * 1e3:.2f} ms step of one GPU"
    return [
        F(id="001.worked.weights_share", quantity="weight read share of the step", note_text="85",
          unit="%", ledger=t["w"] / total, tol=2.5,
          reason=f"{wk.eight}: the weight read is {t['w'] * 1e3:.2f} ms of {step} ({t['w'] / total:.1%})"),
        F(id="001.worked.indexer_share", quantity="indexer read share of the step", note_text="10",
          unit="%", ledger=t["idx"] / total, tol=2.5,
          reason=f"{wk.eight}: the indexer read is {t['idx'] * 1e3:.3f} ms of {step} ({t['idx'] / total:.1%})"),
        F(id="001.worked.rest_share", quantity="communication + KV + indexer share", note_text="<15",
          unit="%", ledger=1 - t["w"] / total, note_own=own_rest,
          reason=f"from the note's own times the non-weight share is "
                 f"({' + '.join(f'{v:g}' for k, v in NOTE_MS.items() if k != 'w')}) ms / {own:.2f} ms = "
                 f"{own_rest:.1%}, not under 15 % (its rounded shares 4 + 2 + 3 + 10 add up to 19 %); the "
                 f"ledger's one GPU, with ceil(32/8) = {wk.gpu.requests_per_gpu} requests, spends "
                 f"{1 - t['w'] / total:.1%} of its step off the weight read"),
    ]
