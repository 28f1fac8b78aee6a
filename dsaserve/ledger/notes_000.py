"""Note 000 ("部署之后的第一条请求") figure by figure: model constants, expert bytes under EP8, the KV-pool
arithmetic (656 / 132 / 53,940 B, 20-30 GB per GPU, 6,742 B/token/GPU, 3-4 M tokens), pages of an 8K
prompt, eager-launch costs and the mem_fraction_static case.

Owns: the catalogue of note 000's numbers, each computed by the ledger's functions under the note's
stated inputs (8 x 141 GB H200, TP8, layer-split KV, mem_fraction_static 0.85). Pure Python.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from dsaserve.ledger.deployment import Workload
from dsaserve.ledger.kv import kv_capacity
from dsaserve.ledger.notes import NOTE_DP_EP8, NOTE_TP8, Figure, NoteContext
from dsaserve.ledger.timeline import decode_launches, operator_list
from dsaserve.ledger.units import GB, M_TOKENS
from dsaserve.ledger.weights import stored_per_gpu

F = partial(Figure, note="000")


def figures(c: NoteContext) -> list[Figure]:
    return _constants(c) + _weights(c) + _kv(c) + _capacity(c) + _first_request(c)


def _constants(c: NoteContext) -> list[Figure]:
    cfg = c.cfg
    w = "权重装载:744B FP8 怎样落到每张卡上"
    pairs = [("hidden_size", 6144, cfg.hidden_size), ("num_hidden_layers", 78, cfg.num_hidden_layers),
             ("n_routed_experts", 256, cfg.n_routed_experts), ("num_experts_per_tok", 8, cfg.num_experts_per_tok),
             ("first_k_dense_replace", 3, cfg.first_k_dense_replace),
             ("moe_intermediate_size", 2048, cfg.moe_intermediate_size),
             ("num_attention_heads", 64, cfg.num_attention_heads), ("q_lora_rank", 2048, cfg.q_lora_rank),
             ("kv_lora_rank", 512, cfg.kv_lora_rank), ("qk_nope_head_dim", 192, cfg.qk_nope_head_dim),
             ("qk_rope_head_dim", 64, cfg.qk_rope_head_dim), ("v_head_dim", 256, cfg.v_head_dim),
             ("index_n_heads", 32, cfg.index_n_heads), ("index_head_dim", 128, cfg.index_head_dim),
             ("index_topk", 2048, cfg.index_topk), ("MTP layer index", 78, cfg.mtp_layer_ids[0])]
    return [F(id=f"000.model.{k.replace(' ', '_')}", where=w, quantity=k, note_text=str(n), unit="", ledger=v)
            for k, n, v in pairs]


def _weights(c: NoteContext) -> list[Figure]:
    inv, cfg = c.inv, c.cfg
    matrix = cfg.moe_intermediate_size * cfg.hidden_size
    w = "权重装载:744B FP8 怎样落到每张卡上"
    return [
        F(id="000.weights.on_disk", where=w, quantity="checkpoint bytes ('七百多 GB')", note_text="700-799",
          unit="GB", ledger=inv.total_bytes(), tol=0),
        F(id="000.ep.experts_per_rank", where=w, quantity="routed experts per rank under EP8", note_text="32",
          unit="", ledger=cfg.n_routed_experts // NOTE_DP_EP8.ep),
        F(id="000.ep.matrix_bytes", where=w, quantity="one expert matrix (2048 x 6144 FP8)", note_text="12.6",
          unit="MB", ledger=matrix),
        F(id="000.ep.expert_bytes", where=w, quantity="one expert, three matrices + block scales",
          note_text="37.7", unit="MB", ledger=inv.expert_bytes, tol=0.1,
          reason="3 x 12.58 MB = 37.75 MB plus 9,216 B of block scales = 37.76 MB; the note leaves the scales out"),
        F(id="000.ep.layer_experts", where=w, quantity="32 experts of one layer on one rank", note_text="1.2",
          unit="GB", ledger=32 * inv.expert_bytes),
        F(id="000.mtp.eh_proj_in", where=w, quantity="eh_proj input width (6144 x 12288)", note_text="12288",
          unit="", ledger=2 * cfg.hidden_size),
    ]


def _kv(c: NoteContext) -> list[Figure]:
    kv = c.kv()
    w = "显存预算:KV 池的页数是一次前向量出来的"
    two20 = "the ledger's 1M = 2^20 tokens: 53,940 B x 1,048,576 = 56.6 GB; 53.9 GB is 53,940 B x 10^6 tokens"
    return [
        F(id="000.kv.main_per_layer", where=w, quantity="main KV bytes/token/layer (fp8_ds_mla)", note_text="656",
          unit="B", ledger=kv.main_per_layer),
        F(id="000.kv.described_layout", where=w, quantity="bytes of the layout as the note describes it "
          "('576 维 + 8 字节 FP32 缩放')", note_text="584", unit="B", ledger=kv.main_per_layer,
          reason="fp8_ds_mla is 512 FP8 nope + 4 FP32 scales (16 B) + 64 BF16 rope (128 B) = 656; the note's "
                 "'576 dims + one 8-byte scale' adds up to 584"),
        F(id="000.kv.indexer_per_layer", where=w, quantity="indexer bytes/token/layer", note_text="132", unit="B",
          ledger=kv.indexer_per_layer),
        F(id="000.kv.main_per_token", where=w, quantity="78 x 656", note_text="51168", unit="B", ledger=kv.main),
        F(id="000.kv.indexer_per_token", where=w, quantity="21 x 132", note_text="2772", unit="B",
          ledger=kv.indexer),
        F(id="000.kv.per_token", where=w, quantity="KV per token, all layers", note_text="53940", unit="B",
          ledger=kv.total),
        F(id="000.kv.request_1m", where=w, quantity="KV of one 1M-token request", note_text="53.9", unit="GB",
          ledger=kv.total * M_TOKENS,
          reason=two20 + ": the whole gap is 10^6 against 2^20 tokens, the 'token 计算方式' the note itself names "
                 "(2^20 is a whole number of 64-token pages, so page alignment adds nothing)"),
        F(id="000.prefill.main_1m", where="长 prefill 的第一条", quantity="main KV written by a 1M prefill",
          note_text="53.9", unit="GB", ledger=kv.main * M_TOKENS,
          reason="51,168 B x 2^20 = 53.65 GB of main KV; 53.9 GB is the note's main + indexer total (53,940 B) "
                 "x 10^6 tokens"),
        F(id="000.prefill.indexer_1m", where="长 prefill 的第一条", quantity="indexer K of a 1M prefill",
          note_text="2.8", unit="GB", ledger=kv.indexer * M_TOKENS,
          reason="21 x 132 B x 2^20 = 2.91 GB (2.82 GB with 128 B keys)"),
    ]


def _capacity(c: NoteContext) -> list[Figure]:
    cfg, hw = c.cfg, c.hw
    asm = replace(c.asm, moe_dense_tp_size=0)  # pure TP8: dense MLPs split like everything else
    weights = sum(stored_per_gpu(c.inv, NOTE_TP8, asm).values())
    cap = kv_capacity(cfg, NOTE_TP8, hw, Workload(), asm, weights)
    cap95 = kv_capacity(cfg, NOTE_TP8, hw, Workload(), replace(asm, mem_fraction_static=0.95), weights)
    bpt = cap.bytes_per_token_gpu
    w = "显存预算:KV 池的页数是一次前向量出来的"
    return [
        F(id="000.cap.weights_per_gpu", where=w, quantity="weights per GPU under TP8", note_text="93", unit="GB",
          ledger=weights, reason="744 GB / 8 leaves out the BF16 embedding and lm_head (2 B/param), the block "
                                 "scales, and the A-projections every rank replicates"),
        F(id="000.cap.pool_per_gpu", where=w, quantity="KV pool per GPU (0.85 x 141 GB - weights)",
          note_text="20-30", unit="GB", ledger=cap.pool_bytes, tol=0),
        F(id="000.cap.bytes_per_token_gpu", where=w, quantity="KV bytes per token per GPU (1/8 of the layers)",
          note_text="6742", unit="B", ledger=bpt),
        F(id="000.cap.tokens_20gb", where=w, quantity="tokens per GPU in 20 GB ('300万')", note_text="3", unit="M",
          ledger=20 * GB / bpt),
        F(id="000.cap.tokens_30gb", where=w, quantity="tokens per GPU in 30 GB ('400万')", note_text="4", unit="M",
          ledger=30 * GB / bpt, tol=0.25,
          reason="30 GB / 6,742.5 B = 4.45 M tokens; the note's range stops at 4 M"),
        F(id="000.cap.cluster_tokens", where=w, quantity="tokens the 8 GPUs hold together", note_text="24-32",
          unit="M", ledger=cap.cluster_tokens, tol=0,
          reason="under the layer split every token sits on all 8 GPUs (1/8 of its layers each), so the cluster "
                 f"holds what one GPU holds ({cap.tokens_per_gpu / 1e6:.2f} M here); 8 x is a double count"),
        F(id="000.cap.request_per_gpu", where=w, quantity="one 1M request's KV on each GPU", note_text="6.7",
          unit="GB", ledger=cap.request_bytes_per_gpu,
          reason="6,742.5 B x 2^20 = 7.07 GB; 6.7 GB is 6,742 B x 10^6 tokens"),
        F(id="000.cap.requests_fit", where=w, quantity="1M requests the pool holds ('数条', under ten)",
          note_text="2-9", unit="", ledger=cap.requests_fit, tol=0),
        F(id="000.case3.pool_shrink", where="故障案例 案例三", quantity="KV pool lost going 0.95 -> 0.85 ('约一成')",
          note_text="10", unit="%", ledger=1 - cap.pool_bytes / cap95.pool_bytes, tol=5,
          reason=f"with {weights / GB:.1f} GB of weights per GPU the pool is the remainder: "
                 f"{cap95.pool_bytes / GB:.1f} GB -> {cap.pool_bytes / GB:.1f} GB; 0.1 x 141 GB is a third of it"),
    ]


def _first_request(c: NoteContext) -> list[Figure]:
    launches = decode_launches(operator_list(c.cfg, NOTE_DP_EP8, c.asm), c.asm)
    w = "第一条请求真正走的路"
    why = ("the 15-operator list has this many launches per step at one kernel per operator; the note's 'thousands "
           "of launches' needs ~1.2 kernels per operator")
    return [
        F(id="000.first.pages_8k", where=w, quantity="KV pages of an 8K prompt", note_text="128", unit="",
          ledger=-(-8192 // c.asm.page_size)),
        F(id="000.first.chunks_1m", where="长 prefill 的第一条", quantity="32K chunks of 1M", note_text="32", unit="",
          ledger=-(-M_TOKENS // 32768)),
        F(id="000.first.eager_ms_lo", where=w, quantity="eager launch cost per step at 3 us", note_text="3",
          unit="ms", ledger=launches * 3e-6, reason=why),
        F(id="000.first.eager_ms_hi", where=w, quantity="eager launch cost per step at 5 us", note_text="5",
          unit="ms", ledger=launches * 5e-6, reason=why),
        F(id="000.first.eager_100_tokens", where=w, quantity="eager cost over 100 tokens at 4 us ('几百毫秒')",
          note_text="100-999", unit="ms", ledger=100 * launches * 4e-6, tol=0),
        F(id="000.case2.tpot_step", where="故障案例 案例二", quantity="TPOT step when batch 9-16 runs eager (3 us)",
          note_text="2-3", unit="ms", ledger=launches * 3e-6, tol=0),
    ]
