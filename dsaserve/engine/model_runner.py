"""ModelRunner: owns the device side of one rank — the startup chain from "load weights" to "ready",
and the forward of every step.

Owns (startup chain, in order): init distributed (TP / EP ranks; no-op for one rank) -> resolve the
checkpoint -> build the model on the device (this rank's shard) -> load weights with
the coverage check (or `--load-format dummy`) -> finalize (dequantise for the reference path / keep FP8 for
the GPU kernels; absorb kv_b) -> size and allocate the KV pool once -> warmup and CUDA-graph capture ->
tokenizer. Each phase is timed into `startup_time`. What only looks back at a start — the kernel precompile's
wait, the warm-start record, the memory profile's budget, the spec list saved at Up, `manifest()` (what
`/startup` and `dsaserve serve` print) — is the `RunnerStartup` mixin's (engine/runner_startup.py). The
scheduler never touches torch devices: it hands a ForwardBatch to `forward()` and gets logits back.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.config import ModelConfig, load_config
from dsaserve.distributed import collectives
from dsaserve.distributed.parallel_state import initialize_model_parallel, local_device
from dsaserve.distributed.sharding import require_fp8_aligned
from dsaserve.engine import kernel_precompile, prompt_logprobs
from dsaserve.engine.cuda_graph_runner import CudaGraphRunner, decode_buckets
from dsaserve.engine.decode_graphs import DecodeGraphs, few_row_widths, width_classes
from dsaserve.engine.dp_step import A2A, GATHER, SKIP, DPStep, DPStepSync, empty_batch
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.gemm_tuning import tune_model
from dsaserve.engine.kv_pool import PAGE_SIZE, KVPool, pool_pages_for_budget
from dsaserve.engine.memory_profile import CompileCache, MemoryProfile, warmup_prefill
from dsaserve.engine.mtp_graphs import capture_mtp_graphs
from dsaserve.engine.overlap import resolve_placeholders_
from dsaserve.engine.piecewise_runner import PiecewiseRunner
from dsaserve.engine.runner_startup import PhaseTimer, RunnerStartup
from dsaserve.engine.warmup import KernelLoads, warm_core_shapes, warm_mtp, warm_sampler
from dsaserve.engine.warmup_plan import WarmupPlan
from dsaserve.errors import CheckpointError
from dsaserve.kernels import cublaslt_tuning
from dsaserve.kernels.registry import get_ops
from dsaserve.model.forward_batch import ForwardBatch, as_decode_rows, one_token_rows
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.model.layers.moe import fold_device_expert_counts
from dsaserve.weights.loader import LoadReport, load_checkpoint, load_dummy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 64 << 20  # CPU reference path: enough for ~12K tokens of the tiny configs


class ModelRunner(RunnerStartup):
    """One rank's device side, built from the EngineArgs (validated there, once). `rank` / `dist_init_method`
    place this process in a multi-rank layout: default $RANK and `tcp://<--dist-init-addr>` (or env://)."""

    def __init__(self, args: EngineArgs, rank: int | None = None, dist_init_method: str | None = None,
                 graph_reserve_bytes: int = 1 << 30):
        self.args = args
        args.check_device()
        device = args.resolved_device()
        self.startup_time: dict[str, float] = {}
        self._start_precompile(device)  # the recorded kernels compile in parallel; waited for before the first forward
        self._init_parallel(args, device, rank, dist_init_method)
        self._init_state(args, graph_reserve_bytes)
        torch.manual_seed(args.seed)
        with PhaseTimer(self.startup_time, "resolve_checkpoint"):
            self.checkpoint, self.cfg = self._resolve(args.model, args.load_format)
        args.check_layout(self.cfg)  # heads / experts / 128-blocks against the ranks: before any weight is read
        self._check_kv_budget(args)
        self.max_model_len = args.max_model_len or self.cfg.max_position_embeddings  # within it: check_layout
        with PhaseTimer(self.startup_time, "load_weights"):
            self.model, self.load_report = self._build_and_load(args.load_format, args.loads_mtp)
        self._wait_precompile()
        # warm start: the kernels a start of this configuration loaded, into the JITs before any forward needs them
        self.warm_start = self._preload() if self.device.type == "cuda" else None
        if self.device.type == "cuda" and cublaslt_tuning.TUNED and not args.disable_cuda_graph:
            with PhaseTimer(self.startup_time, "gemm_tuning"):  # before the memory profile and any capture
                self.gemm_tuning = tune_model(self.model, self.device)
            if self.gemm_tuning and "error" in self.gemm_tuning:
                logging.getLogger(__name__).warning("cuBLASLt timing skipped, torch's choices stay: %s",
                                                    self.gemm_tuning["error"])
        kv_budget_bytes = args.kv_cache_bytes
        if self.device.type == "cuda" and args.num_pages is None and kv_budget_bytes is None:
            kv_budget_bytes = self._profile_memory()
        with PhaseTimer(self.startup_time, "kv_pool"):
            self.kv_pool = self._allocate_pool(get_kv_layout(args.kv_layout), args.num_pages, kv_budget_bytes)
        # overlap scheduling (engine/overlap.py): the last step's samples, which the next step's placeholder input
        # ids read on the device; with drafts (engine/mtp.py), the last step's drafts, which its verify rows read so;
        # allocated before the capture (the graphs hold its address)
        future = args.max_running_requests * (args.speculative_num_steps if args.speculative_algorithm else 1)
        self.future_token_ids = (torch.zeros(future, dtype=torch.int64, device=self.device)
                                 if args.overlap_schedule or args.speculative_algorithm else None)
        self.last_prompt_logprobs: tuple[torch.Tensor, ...] | None = None  # the last forward's (_prompt_logprobs)
        with PhaseTimer(self.startup_time, "warmup_collectives"):  # communication buffers: one call of each kind
            self.warmed_collectives = collectives.warmup(self.device)
        if self.device.type == "cuda":
            self._warmup_and_capture()
        with PhaseTimer(self.startup_time, "tokenizer"):
            self.tokenizer = self._load_tokenizer()
        self.page_size, self.num_pages = PAGE_SIZE, self.kv_pool.num_pages
        self.eos_token_ids = self.cfg.eos_token_ids
        fold_device_expert_counts(reset=True)  # profile / warmup / capture forwards are not traffic
        self._mark_up()

    def _init_parallel(self, args: EngineArgs, device: str, rank: int | None, dist_init_method: str | None) -> None:
        """The process groups, this rank's device and, under DP-attention, the step agreement."""
        with PhaseTimer(self.startup_time, "init_distributed"):
            self.parallel = initialize_model_parallel(
                args.tensor_parallel_size, args.expert_parallel_size, args.moe_a2a or args.enable_dp_attention,
                device, dist_init_method or _init_method(args), rank=rank, timeout_s=args.dist_timeout,
                dp_attention=args.enable_dp_attention)
        self.device = local_device(device) if self.parallel.world_size > 1 else torch.device(device)
        # DP-attention: every main forward starts with the ranks' agreement on the step (engine/dp_step.py)
        self.dp_sync = None if not self.parallel.dp_attention else DPStepSync(
            self.parallel.dp_cpu_group, self.parallel.world_size, decode_buckets(args.graph_max_bs),
            self.parallel.world_size * max(args.chunk_size, args.max_num_batched_tokens), args.dp_moe)
        # the memory profile and the prefill warmup run as the largest gather step the rule allows
        self.dp_world = self.parallel.world_size if self.dp_sync is not None and args.dp_moe != A2A else 1
        self.dp_step: DPStep | None = None  # the last agreement (tests, bench)

    def _init_state(self, args: EngineArgs, graph_reserve_bytes: int) -> None:
        """Sizes and the start-up bookkeeping filled in later (profile, graphs, warmup, compile counters)."""
        self.dtype = DTYPES[args.resolved_dtype()]
        self.chunked_prefill_size, self.cuda_graph_max_bs = args.chunk_size, args.graph_max_bs
        self.mem_fraction_static, self.graph_reserve_bytes = args.mem_fraction_static, graph_reserve_bytes
        self.profile: MemoryProfile | None = None
        self.graphs: DecodeGraphs | None = None
        self.mtp_graphs: DecodeGraphs | None = None  # speculative decoding's MTP forwards (engine/mtp_graphs.py)
        self.piecewise: PiecewiseRunner | None = None
        self.warmed_prefill: list[int] = []
        self.warmed: dict[str, Any] = {}
        self.graph_errors: dict[str, str] = {}
        self.gemm_tuning: dict | None = None  # the cuBLASLt choices (kernels/cublaslt_tuning.py), where timed
        cuda = self.device.type == "cuda"
        self.compile_cache = CompileCache(None) if cuda else None
        self.kernel_loads = KernelLoads() if cuda else None  # before any kernel compiles
        self.spec_recorder = kernel_precompile.SpecRecorder() if cuda else None

    @classmethod
    def from_kwargs(cls, model: str, *, rank: int | None = None, dist_init_method: str | None = None,
                    graph_reserve_bytes: int = 1 << 30, **engine_args: Any) -> ModelRunner:
        """`ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", tensor_parallel_size=2)` (tests, bench):
        EngineArgs by keyword, on the CPU unless `device` is given."""
        engine_args.setdefault("device", "cpu")
        return cls(EngineArgs.from_kwargs(model=model, **engine_args), rank=rank, dist_init_method=dist_init_method,
                   graph_reserve_bytes=graph_reserve_bytes)

    # ---- startup phases --------------------------------------------------------------------
    def _resolve(self, model: str, load_format: str) -> tuple[Path | None, ModelConfig]:
        if load_format == "dummy":  # no disk: a built-in name or a config.json is enough
            return None, load_config(model)
        from dsaserve.weights.checkpoint_cache import resolve_checkpoint

        ckpt = resolve_checkpoint(model)
        return ckpt, load_config(ckpt)

    def _build_and_load(self, load_format: str, enable_mtp: bool) -> tuple[DsaForCausalLM, LoadReport]:
        """The model built on the device, its weights filled, finalized; the parts' seconds in the report
        (`cuda_context`: the first device allocation, where torch creates the context if nothing did before)."""
        parts: dict[str, float] = {}
        cuda = self.device.type == "cuda"
        with PhaseTimer(parts, "cuda_context"):
            if cuda:
                torch.empty(1, device=self.device)
        with PhaseTimer(parts, "build"), torch.device(self.device):
            model = DsaForCausalLM(self.cfg, with_mtp=enable_mtp)
        if cuda:  # the reference path computes on dequantised weights
            require_fp8_aligned(model)  # before reading any tensor: TP/EP parts must be whole FP8 blocks
        with PhaseTimer(parts, "fill"):
            report = (load_dummy(model, self.args.seed) if load_format == "dummy"
                      else load_checkpoint(model, self.checkpoint))
        with PhaseTimer(parts, "finalize"):
            model.finalize(self.dtype, self.device, cuda)
            if cuda:
                torch.cuda.synchronize(self.device)  # the fill's and finalize's kernels, not the next phase's
        report.phases = parts
        return model.eval(), report

    def _check_kv_budget(self, args: EngineArgs) -> None:
        """--kv-cache-bytes below one page of the main layers' KV, refused before the weights load (the pool's own
        check, with the MTP layer's KV too, comes after them: minutes into a GPU start)."""
        if args.kv_cache_bytes is None:
            return
        layers = list(range(self.cfg.num_hidden_layers))
        if pool_pages_for_budget(self.cfg, get_kv_layout(args.kv_layout), args.kv_cache_bytes, layers) <= 0:
            raise ValueError(f"--kv-cache-bytes: {args.kv_cache_bytes} bytes is less than one {PAGE_SIZE}-token page "
                             f"of {self.cfg.num_hidden_layers} layers' KV ({args.kv_layout})")

    def _allocate_pool(self, layout: KVLayout, num_pages: int | None, budget: int | None) -> KVPool:
        layers = self.model.kv_layer_ids
        if num_pages is None:
            if budget is None:
                if self.device.type != "cpu":
                    raise ValueError("kv_budget_bytes or num_pages: required on GPU until the memory profile runs")
                budget = DEFAULT_CPU_KV_BYTES
            num_pages = pool_pages_for_budget(self.cfg, layout, budget, layers)
            if num_pages <= 0:
                who = "--kv-cache-bytes" if budget == self.args.kv_cache_bytes else "the memory profile's KV budget"
                raise ValueError(f"{who}: {budget} bytes is less than one {PAGE_SIZE}-token page")
        sink = 1 if self.device.type == "cuda" else 0  # CUDA-graph padding rows write here
        return KVPool(self.cfg, num_pages, layout, layers, PAGE_SIZE, self.dtype, self.device, sink_pages=sink)

    def _warmup_and_capture(self) -> None:
        """CUDA: the configured prefill chunk eagerly, then the piecewise and decode graphs, then what runs
        between and after them (attention-core shapes, sampler variants: engine/warmup_plan.py)."""
        # the chunk's eager forward runs on a preload hit too: the kernels are in the JITs then, but a reused memory
        # profile ran no forward of that size, and a process's first one pays more than its kernels (bench_gpu's
        # first prefill after Up: +32-61 ms over steady in the 9 starts that skipped this, 2.4-3.3x at 2K, 1.7x at 8K;
        # -74 to +19 ms, 0.83-1.12x, in the 51 that ran it)
        self._warmup_prefill()
        if not self.args.disable_cuda_graph and self._graphs_possible():
            with PhaseTimer(self.startup_time, "cuda_graph_capture"):
                self.piecewise = self._capture("piecewise", self._capture_piecewise)
                self.graphs = self._capture("decode", self._capture_decode)
                if self.graphs is not None and self.args.speculative_algorithm is not None and self.dp_sync is None:
                    self.mtp_graphs = self._capture("mtp", lambda: capture_mtp_graphs(
                        self.model, self.kv_pool, self.graphs, not self._preload_hit()))
        with PhaseTimer(self.startup_time, "warmup_shapes"):
            max_pages = -(-self.max_model_len // PAGE_SIZE)
            plan = WarmupPlan.build(self.graphs.max_bs if self.graphs else 0,
                                    self.piecewise.buckets if self.piecewise else [], max_pages, PAGE_SIZE,
                                    self.cfg.index_topk)
            # every kernel preloaded and none loaded since: one core shape per class, not the row sweep
            preloaded = self.warm_start is not None and self.warm_start.covers(self._jit_loads())
            cores = warm_core_shapes(self.piecewise, plan, self.max_model_len, preloaded) if self.piecewise else 0
            drafter = self.args.speculative_algorithm is not None and self.kv_pool.sink_page >= 0
            # the MTP layer's MoE meets the other ranks': its shape list may not hang on a rank's own preload hit
            one_rank_hit = preloaded and self.parallel.world_size == 1
            mtp = warm_mtp(self.model, self.kv_pool, plan, self.max_model_len, one_rank_hit,
                           decode_rows=self.mtp_graphs is None) if drafter else 0
            sampler = warm_sampler(self.device, self.cfg.vocab_size, tuple(self.cfg.eos_token_ids),
                                   self.model.logits_dtype())
            self.warmed = {"decode_buckets": list(plan.decode), "piecewise_buckets": list(plan.piecewise),
                           "core_shapes": cores, "mtp_shapes": mtp,
                           "core_warmup": "per class (preloaded)" if preloaded else "row sweep",
                           "sampler_variants": sampler}

    def _warmup_prefill(self) -> None:
        """The chunk size, and one step just over the piecewise buckets: large eager steps of either alignment
        class (Triton specialises integer arguments divisible by 16) compile before Up."""
        with PhaseTimer(self.startup_time, "warmup"):
            large = [max(self.args.piecewise_tokens) + 1] if self.args.piecewise_tokens else []
            self.warmed_prefill = warmup_prefill(self.model, self.kv_pool, [self.chunked_prefill_size, *large],
                                                 self.cfg.vocab_size, self.dp_world)

    @property
    def _dp_gather_graphs(self) -> bool:
        """DP-attention with the gather MoE: the padded decode steps replay graphs (engine/dp_step.py)."""
        return self.dp_sync is not None and self.args.dp_moe != A2A

    def _graphs_possible(self) -> bool:
        if self.parallel.moe_a2a and not self._dp_gather_graphs:  # host split sizes: eager every step
            COUNTERS.add("eager_fallbacks.moe_a2a", 0)
            return False
        if not getattr(get_ops(self.device), "graph_safe", False):
            COUNTERS.add("eager_fallbacks.kernels_not_graph_safe", 0)
            return False
        return True

    def _preload_hit(self) -> bool:
        """One rank whose preload loaded every recorded kernel: the eager warm runs before its captures can be
        left out (each rank's record hits or misses on its own, and those forwards hold collectives: several
        ranks run them all)."""
        return (self.parallel.world_size == 1 and self.warm_start is not None
                and self.warm_start.preload_report.get("status") == "hit")

    def _capture(self, kind: str, make) -> Any:
        """make() -> a captured runner, or None when capture fails: serve eagerly rather than not at all
        (the manifest and metrics say why)."""
        try:
            return make()
        except RuntimeError as e:
            self.graph_errors[kind] = f"{type(e).__name__}: {e}"[:500]
            logging.getLogger(__name__).warning("%s CUDA graphs not captured, those steps run eagerly: %s", kind,
                                                self.graph_errors[kind])
            COUNTERS.add(f"eager_fallbacks.{kind}_capture_failed", 0)
            torch.cuda.synchronize()
            return None

    def _capture_piecewise(self) -> PiecewiseRunner | None:
        if not self.args.piecewise_tokens or self.dp_sync is not None:  # DP: its MoE exchange is not segmented
            return None
        runner = PiecewiseRunner(self.model, self.kv_pool, self.args.piecewise_tokens, self.args.max_running_requests,
                                 -(-self.max_model_len // PAGE_SIZE), self.future_token_ids)
        runner.capture(warm_each=not self._preload_hit())
        return runner

    def _capture_decode(self) -> DecodeGraphs:
        max_pages = -(-self.max_model_len // PAGE_SIZE)
        narrow = not self.args.disable_narrow_decode_graphs and not self._dp_gather_graphs
        graphs = DecodeGraphs(lambda pages, max_bs=None: CudaGraphRunner(
            self.model, self.kv_pool, max_bs or self.cuda_graph_max_bs, pages, self.kv_pool.sink_page,
            self.future_token_ids, moe_gather=self._dp_gather_graphs, table_rows=self.args.max_running_requests),
            width_classes(max_pages, self.cfg.index_topk, PAGE_SIZE, narrow),
            few_row_widths(max_pages, self.cfg.index_topk, PAGE_SIZE, narrow))
        # its own pool, not the piecewise graphs': its hidden outputs then live where no piecewise replay writes
        graphs.capture(warm_each=not self._preload_hit())
        return graphs

    def _load_tokenizer(self):
        """The checkpoint's tokenizer (offline Engine: prompts as text); the server's processes read their own.
        Random weights (`--load-format dummy`) keep the tokenizer of the directory or packaged model named."""
        where = self.checkpoint if self.checkpoint is not None else _dummy_tokenizer_dir(self.args.model)
        if where is None or not (where / "tokenizer.json").exists():
            return None
        from tokenizers import Tokenizer

        path = where / "tokenizer.json"
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None

    # ---- steps -----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] (the lm_head's dtype: bf16 or float32) for one scheduled step
        (a replayed decode step's may be a view of the graph's output: read them before the next forward). A host
        batch goes to the
        device here: into a graph runner's static inputs in one copy, or field by field for an eager step.
        Under overlap scheduling an input id -1-j is the token the step before sampled in row j
        (`future_token_ids[j]`), resolved on the device — inside the decode graph for a replay. Under
        DP-attention every rank calls this, `forward_with_hidden` or `forward_idle()` once per step (they agree on the
        step first), then with speculative decoding `forward_mtp` as many times as every other rank."""
        if self.dp_sync is not None:
            return self._dp_forward(batch)
        return self._forward(batch)

    def route(self, batch: ForwardBatch, bucket: int | None = None) -> str:
        """The path `forward` takes: 'decode_graph' (every row decodes, within the captured buckets; under
        DP-attention the agreed `bucket`), 'piecewise' (within the token buckets), 'eager_large' (over them, by
        design), else 'eager:<reason>' (counted), or 'eager' where no graph applies by design (CPU,
        --disable-cuda-graph, a DP step the ranks agreed to run eagerly)."""
        if (self.graphs is None and self.piecewise is None) or (self.dp_sync is not None and bucket is None):
            return "eager"
        reason = self.graphs.fallback_reason(batch, bucket) if self.graphs is not None else "no_decode_graphs"
        if reason is None:
            return "decode_graph"
        if self.piecewise is not None:
            reason = self.piecewise.fallback_reason(batch)
            if reason is None:
                return "piecewise"
            if reason == "tokens_over_piecewise_max":
                return "eager_large"  # by design (warmup_plan.piecewise_buckets says why), not a fallback
        return f"eager:{reason}"

    def forward_idle(self, mtp_layer: int | None = None) -> None:
        """DP-attention: nothing scheduled on this rank this step while others step. The main forward's
        idle step takes part in the step's agreement and then replays padding through the step's graph, or
        runs the MoE layers' collectives with no tokens of its own (`DsaForCausalLM.forward_idle`);
        `mtp_layer=k` pairs with another rank's model-level `forward_mtp(k=k)`: the zero-token exchange of
        that layer, so its collectives never hang."""
        if self.dp_sync is not None and mtp_layer is None:
            self._dp_forward(None)
            return
        self.model.forward_idle(mtp_layer)

    def _forward(self, batch: ForwardBatch, step: DPStep | None = None) -> torch.Tensor:
        """One rank's forward. `step`: a DP gather step — a graph step replays the agreed bucket where this
        rank can; otherwise eager, its own tokens, the MoE layers padding them to the agreed rows."""
        bucket = step.rows if step is not None and step.graph else None
        route = self.route(batch, bucket)
        if route == "decode_graph":
            self.last_prompt_logprobs = None
            return self.graphs.replay(batch, bucket)
        if route == "eager_large":
            COUNTERS.add("eager_large_steps")
        elif route.startswith("eager:"):
            COUNTERS.add(f"eager_fallbacks.{route.removeprefix('eager:')}")
        return self._run(batch, route == "piecewise", step)[0]

    def forward_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits as `forward` gives them, the final hidden rows [T, H] of every token): speculative decoding's
        step (engine/mtp.py), whose MTP layer reads the hidden rows. A step whose every token samples (decode and
        verify rows) replays a decode graph as one token a row (`as_decode_rows`) where one holds it; else the
        piecewise graphs where they take it, else eager."""
        if self.dp_sync is not None:  # agreed as an eager step: its MoE layers meet the others' as `_dp_forward`'s
            step = self.dp_step = self.dp_sync.agree(batch, graph=False)
            return self._run(batch, False, step if step.mode == GATHER else None)
        if self.graphs is not None:  # verify rows as one token a row; a decode step without drafts as it is
            rows = as_decode_rows(batch) or (batch if batch.samples_every_token else None)
            if rows is not None and self.graphs.fallback_reason(rows) is None:
                self.last_prompt_logprobs = None
                return self.graphs.replay_with_hidden(rows)
        return self._run(batch, self.piecewise is not None and self.piecewise.fallback_reason(batch) is None)

    def _run(self, batch: ForwardBatch, piecewise: bool, step: DPStep | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, hidden rows) of a step on the piecewise graphs or eagerly (a host batch moved to the device,
        its placeholders resolved), and its prompt entries."""
        self.last_prompt_logprobs = None
        if piecewise:
            logits, hidden = self.piecewise.forward_with_hidden(batch)
        else:
            if batch.input_ids.device != self.device:
                batch = batch.to(self.device)
            if self.future_token_ids is not None:
                resolve_placeholders_(batch.input_ids, self.future_token_ids)
            if step is not None:
                batch = dataclasses.replace(batch, dp_rows=step.rows, dp_tokens=step.tokens)
            logits, hidden = self.model(batch, self.kv_pool)
        self._prompt_logprobs(batch, hidden)
        return logits, hidden

    def forward_mtp(self, batch: ForwardBatch | None, prev_hidden: torch.Tensor | None,
                    drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The MTP layer over a host batch: its KV at the batch's slots; its logits and normed output at the batch's
        logits rows (`DsaForCausalLM.forward_mtp`; engine/mtp.py builds the batch), replayed as one token a row in
        the MTP graphs where they hold the batch (engine/mtp_graphs.py), else eagerly. Under DP-attention
        every rank calls this together, a rank with no rows with `batch` None (its MoE layer's share of the
        exchange; None returned), after agreeing on the step as the main forward does. `drafts`: the last MTP
        forward's tokens on the device, which an input id -1-j stands for (chained drafts)."""
        step = None
        if self.dp_sync is not None:
            step = self.dp_step = self.dp_sync.agree(batch, graph=False)
            if step.mode == SKIP:
                return None
            if batch is None:
                gather = step.mode == GATHER
                self.model.forward_idle(0, step.rows if gather else 0, step.tokens if gather else ())
                return None
        if self.mtp_graphs is not None:  # never under DP-attention
            out = self._replay_mtp(batch, prev_hidden, drafts)
            if out is not None:
                return out
        batch = batch.to(self.device)
        if drafts is not None:
            resolve_placeholders_(batch.input_ids, drafts)
        if step is not None and step.mode == GATHER:
            batch = dataclasses.replace(batch, dp_rows=step.rows, dp_tokens=step.tokens)
        return self.model.forward_mtp(batch, self.kv_pool, prev_hidden, with_hidden=True)

    def _replay_mtp(self, batch: ForwardBatch, prev_hidden: torch.Tensor, drafts: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`forward_mtp` in an MTP graph, one token a row; None (counted by reason) where none holds the batch."""
        if batch.num_tokens > self.mtp_graphs.max_bs:  # a long prompt's extend: eager by design
            reason = "batch_over_max_bs"
        else:
            rows = batch if all(n == 1 for n in batch.host_lens()[1]) else one_token_rows(batch)
            reason = self.mtp_graphs.fallback_reason(rows)
            if reason is None:
                return self.mtp_graphs.runner_for(rows).replay_mtp(rows, prev_hidden, drafts)
        COUNTERS.add(f"mtp_eager.{reason}")
        return None

    def _prompt_logprobs(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        """The step's prompt entries from its hidden rows, on the device (`last_prompt_logprobs`, read by the
        engine before the next forward; engine/prompt_logprobs.py)."""
        if batch.prompt_rows is not None:
            self.last_prompt_logprobs = prompt_logprobs.compute(self.model, hidden, batch.prompt_rows,
                                                                batch.prompt_targets, batch.prompt_k)

    def _dp_forward(self, batch: ForwardBatch | None) -> torch.Tensor | None:
        """DP-attention: agree on the step with the other ranks (engine/dp_step.py), then run it; None when
        this rank had nothing scheduled (its padding replays the step's graph, or its MoE layers run idle)."""
        step = self.dp_step = self.dp_sync.agree(batch)
        if step.mode == SKIP:
            return None
        gather = step if step.mode == GATHER else None
        if batch is not None:
            return self._forward(batch, gather)
        idle = empty_batch(self.page_size)
        if gather is not None and step.graph and self.graphs is not None \
                and self.graphs.fallback_reason(idle, step.rows) is None:
            COUNTERS.add("idle_steps")
            self.graphs.replay(idle, step.rows)
        else:
            self.model.forward_idle(dp_rows=step.rows, dp_tokens=step.tokens if gather else ())
        return None


def _dummy_tokenizer_dir(model: str) -> Path | None:
    """Where a dummy load's tokenizer is: the checkpoint directory given, or the packaged model of that name."""
    from dsaserve.weights.checkpoint_cache import packaged_checkpoint

    p = Path(model).expanduser()
    return p if p.is_dir() else packaged_checkpoint(model)


def _init_method(args: EngineArgs) -> str | None:
    """--dist-init-addr host:port -> tcp://host:port (None: $MASTER_ADDR / $MASTER_PORT, env://)."""
    return f"tcp://{args.dist_init_addr}" if args.dist_init_addr else None
