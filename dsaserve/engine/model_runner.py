"""ModelRunner: owns the device side of one rank — the startup chain from "load weights" to "ready",
and the forward of every step.

Owns (startup chain, in order): init distributed (TP / EP ranks; no-op for one rank) -> resolve the
checkpoint -> build the model on the device (this rank's shard) -> load weights with
the coverage check (or `--load-format dummy`) -> finalize (dequantise for the reference path / keep FP8 for
the GPU kernels; absorb kv_b) -> size and allocate the KV pool once -> tokenizer. Each phase is timed into
`startup_time`; `manifest()` is what `/startup` and `dsaserve serve` print. The scheduler never touches
torch devices: it hands a ForwardBatch to `forward()` and gets logits back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch

from dsaserve.common import envs
from dsaserve.common.counters import COUNTERS
from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.config import ModelConfig, load_config
from dsaserve.distributed import collectives
from dsaserve.distributed.parallel_state import initialize_model_parallel, local_device
from dsaserve.distributed.sharding import require_fp8_aligned
from dsaserve.engine import early_cuda, kernel_precompile
from dsaserve.engine.cuda_graph_runner import CudaGraphRunner, decode_buckets
from dsaserve.engine.dp_step import A2A, GATHER, SKIP, DPStep, DPStepSync, empty_batch
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.kv_pool import PAGE_SIZE, KVPool, pool_pages_for_budget
from dsaserve.engine.memory_profile import CompileCache, MemoryProfile, profile_memory, warmup_prefill
from dsaserve.engine.overlap import resolve_placeholders_
from dsaserve.engine.piecewise_runner import PiecewiseRunner
from dsaserve.engine.warm_start import WarmStart, config_parts, device_parts, prewarm_triton_key
from dsaserve.engine.warmup import KernelLoads, warm_core_shapes, warm_sampler
from dsaserve.engine.warmup_plan import WarmupPlan
from dsaserve.errors import CheckpointError
from dsaserve.kernels.registry import describe as describe_kernels
from dsaserve.kernels.registry import get_ops
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.model.layers.moe import fold_device_expert_counts
from dsaserve.weights.loader import LoadReport, load_checkpoint, load_dummy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CPU_KV_BYTES = 64 << 20  # CPU reference path: enough for ~12K tokens of the tiny configs


class _Timer:
    def __init__(self, sink: dict[str, float], phase: str):
        self.sink, self.phase = sink, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.sink[self.phase] = round(self.sink.get(self.phase, 0.0) + time.perf_counter() - self.t0, 4)


class ModelRunner:
    """One rank's device side, built from the EngineArgs (validated there, once). `rank` / `dist_init_method`
    place this process in a multi-rank layout: default $RANK and `tcp://<--dist-init-addr>` (or env://)."""

    def __init__(self, args: EngineArgs, rank: int | None = None, dist_init_method: str | None = None,
                 graph_reserve_bytes: int = 1 << 30):
        self.args = args
        device = args.resolved_device()
        self.startup_time: dict[str, float] = {}
        # the recorded kernels compile in parallel while this rank initialises and loads weights (a server's
        # scheduler process started it before its imports); waited for before the first forward
        self.precompile = (kernel_precompile.take_pending() or kernel_precompile.start()
                           if str(device).startswith("cuda") else None)
        if str(device).startswith("cuda"):
            prewarm_triton_key()  # Triton's per-process hash, on a thread while this rank initialises and loads
        self._init_parallel(args, device, rank, dist_init_method)
        self._init_state(args, graph_reserve_bytes)
        torch.manual_seed(args.seed)
        with _Timer(self.startup_time, "resolve_checkpoint"):
            self.checkpoint, self.cfg = self._resolve(args.model, args.load_format)
        args.check_layout(self.cfg)  # heads / experts / 128-blocks against the ranks: before any weight is read
        self.max_model_len = min(args.max_model_len or self.cfg.max_position_embeddings,
                                 self.cfg.max_position_embeddings)
        with _Timer(self.startup_time, "load_weights"):
            self.model, self.load_report = self._build_and_load(args.load_format, args.load_mtp)
        if self.precompile is not None:
            with _Timer(self.startup_time, "kernel_precompile_wait"):
                self.precompile.wait()
        # warm start: the kernels a start of this configuration loaded, into the JITs before any forward needs them
        self.warm_start = self._preload() if self.device.type == "cuda" else None
        kv_budget_bytes = args.kv_cache_bytes
        if self.device.type == "cuda" and args.num_pages is None and kv_budget_bytes is None:
            kv_budget_bytes = self._profile_memory()
        with _Timer(self.startup_time, "kv_pool"):
            self.kv_pool = self._allocate_pool(get_kv_layout(args.kv_layout), args.num_pages, kv_budget_bytes)
        # overlap scheduling (engine/overlap.py): the last step's samples, which the next step's placeholder input
        # ids read on the device; allocated before the capture (the graphs hold its address)
        self.future_token_ids = (torch.zeros(args.max_running_requests, dtype=torch.int64, device=self.device)
                                 if args.overlap_schedule else None)
        with _Timer(self.startup_time, "warmup_collectives"):  # communication buffers: one call of each kind
            self.warmed_collectives = collectives.warmup(self.device)
        if self.device.type == "cuda":
            self._warmup_and_capture()
        with _Timer(self.startup_time, "tokenizer"):
            self.tokenizer = self._load_tokenizer()
        self.page_size, self.num_pages = PAGE_SIZE, self.kv_pool.num_pages
        self.eos_token_ids = self.cfg.eos_token_ids
        fold_device_expert_counts(reset=True)  # profile / warmup / capture forwards are not traffic
        self._mark_up()

    def _init_parallel(self, args: EngineArgs, device: str, rank: int | None, dist_init_method: str | None) -> None:
        """The process groups, this rank's device and, under DP-attention, the step agreement."""
        with _Timer(self.startup_time, "init_distributed"):
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
        self.graphs: CudaGraphRunner | None = None
        self.piecewise: PiecewiseRunner | None = None
        self.warmed_prefill: list[int] = []
        self.warmed: dict[str, Any] = {}
        self.graph_errors: dict[str, str] = {}
        cuda = self.device.type == "cuda"
        self.compile_cache = CompileCache(None) if cuda else None
        self.kernel_loads = KernelLoads() if cuda else None  # before any kernel compiles
        self.spec_recorder = kernel_precompile.SpecRecorder() if cuda else None

    def _mark_up(self) -> None:
        """Up: from here a compile or a kernel load counts as after Up; the start's kernel specs are saved."""
        if self.compile_cache is None:
            return
        self.compile_cache.mark_up()
        self.kernel_loads.mark_up()
        self._save_specs()
        self._save_warm_start()
        COUNTERS.add_source(self.compile_cache.compiles_after_up)
        COUNTERS.add_source(self.kernel_loads.read)

    def _save_specs(self) -> None:
        """This start's kernel specs onto the list the next start precompiles (an unwritable cache: logged)."""
        if not self.spec_recorder.installed:
            return
        try:
            self.spec_recorder.save()
        except OSError as e:
            logging.getLogger(__name__).warning("kernel specs not saved to %s: %s", self.spec_recorder.path, e)

    def _jit_loads(self) -> int | None:
        """Triton kernels the JITs compiled or loaded in this process so far (None: not counted)."""
        return self.kernel_loads.count if self.kernel_loads is not None and self.kernel_loads.installed else None

    def _cached_profile(self) -> MemoryProfile | None:
        """The warm-start record's profile, when this start may use it (engine/warm_start.py says when)."""
        if self.warm_start is None:
            return None
        live = {"total_bytes": torch.cuda.mem_get_info(self.device)[1],
                "weights_bytes": torch.cuda.memory_allocated(self.device),
                "mem_fraction_static": self.args.mem_fraction_static, "graph_reserve_bytes": self.graph_reserve_bytes}
        cached = self.warm_start.cached_profile(live)
        return MemoryProfile(**{f.name: cached[f.name] for f in dataclasses.fields(MemoryProfile)}) if cached else None

    def _preload(self) -> WarmStart:
        with _Timer(self.startup_time, "kernel_preload"):
            extra = {"graph_reserve_bytes": self.graph_reserve_bytes, **device_parts(self.device)}
            warm = WarmStart(config_parts(self.args, self.cfg, self.parallel.to_dict(), extra))
            warm.preload(self._jit_loads)
        return warm

    def _save_warm_start(self) -> None:
        """This start's record for the next (only with every graph captured: a start that fell back to eager
        warmed other shapes); kernels loaded after Up are appended to it as they load."""
        if self.warm_start is None or self.graph_errors or not self.spec_recorder.installed:
            return
        profile = dataclasses.asdict(self.profile) if self.profile is not None else None
        try:
            self.warm_start.save(self.spec_recorder.specs, profile)
            self.spec_recorder.mirrors.append(self.warm_start.specs_path)
        except OSError as e:
            logging.getLogger(__name__).warning("warm-start record not saved to %s: %s", self.warm_start.dir, e)

    @classmethod
    def from_kwargs(cls, model: str, *, rank: int | None = None, dist_init_method: str | None = None,
                    graph_reserve_bytes: int = 1 << 30, **engine_args: Any) -> ModelRunner:
        """`ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", tensor_parallel_size=2)` (tests, bench):
        EngineArgs by keyword, on the CPU unless `device` is given."""
        engine_args.setdefault("device", "cpu")
        return cls(EngineArgs.from_kwargs(model=model, **engine_args), rank=rank, dist_init_method=dist_init_method,
                   graph_reserve_bytes=graph_reserve_bytes)

    def _profile_memory(self) -> int:
        """The KV budget the memory profile leaves; over ranks the smallest wins (every rank holds the same
        pages, and under DP-attention every rank's pool must take the same requests)."""
        a = self.args
        with _Timer(self.startup_time, "memory_profile"):
            self.profile = self._cached_profile() or profile_memory(
                self.model, self.cfg, get_kv_layout(a.kv_layout), self.dtype, self.device,
                self.model.kv_layer_ids, max(a.chunk_size, a.max_num_batched_tokens),
                # the largest step the scheduler may form: a full token budget, and every running row eager
                max(a.graph_max_bs, a.max_running_requests), a.mem_fraction_static, self.graph_reserve_bytes,
                activation_copies=2 if a.piecewise_tokens and self.dp_sync is None else 1, dp_world=self.dp_world)
        budget = self.profile.kv_budget_bytes
        if self.parallel.world_size > 1:
            t = torch.tensor([budget], dtype=torch.int64, device=self.device)
            budget = int(collectives.all_reduce(t, self.parallel.world, op="min").item())
        return budget

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
        with _Timer(parts, "cuda_context"):
            if cuda:
                torch.empty(1, device=self.device)
        with _Timer(parts, "build"), torch.device(self.device):
            model = DsaForCausalLM(self.cfg, with_mtp=enable_mtp)
        if cuda:  # the reference path computes on dequantised weights
            require_fp8_aligned(model)  # before reading any tensor: TP/EP parts must be whole FP8 blocks
        with _Timer(parts, "fill"):
            report = (load_dummy(model, self.args.seed) if load_format == "dummy"
                      else load_checkpoint(model, self.checkpoint))
        with _Timer(parts, "finalize"):
            model.finalize(self.dtype, self.device, cuda)
            if cuda:
                torch.cuda.synchronize(self.device)  # the fill's and finalize's kernels, not the next phase's
        report.phases = parts
        return model.eval(), report

    def _allocate_pool(self, layout: KVLayout, num_pages: int | None, budget: int | None) -> KVPool:
        layers = self.model.kv_layer_ids
        if num_pages is None:
            if budget is None:
                if self.device.type != "cpu":
                    raise ValueError("kv_budget_bytes or num_pages: required on GPU until the memory profile runs")
                budget = DEFAULT_CPU_KV_BYTES
            num_pages = pool_pages_for_budget(self.cfg, layout, budget, layers)
            if num_pages <= 0:
                raise ValueError(f"kv_budget_bytes: {budget} bytes is less than one {PAGE_SIZE}-token page")
        sink = 1 if self.device.type == "cuda" else 0  # CUDA-graph padding rows write here
        return KVPool(self.cfg, num_pages, layout, layers, PAGE_SIZE, self.dtype, self.device, sink_pages=sink)

    def _warmup_and_capture(self) -> None:
        """CUDA: the configured prefill chunk eagerly, then the piecewise and decode graphs, then what runs
        between and after them (attention-core shapes, sampler variants: engine/warmup_plan.py)."""
        # every recorded kernel preloaded: the large eager steps' kernels are in the JITs already, and the
        # capture's eager runs do the first-use work; run only if something loads after the preload (below)
        deferred = self._preload_hit()
        if not deferred:
            self._warmup_prefill()
        if not self.args.disable_cuda_graph and self._graphs_possible():
            with _Timer(self.startup_time, "cuda_graph_capture"):
                self.piecewise = self._capture("piecewise", self._capture_piecewise)
                self.graphs = self._capture("decode", self._capture_decode)
        with _Timer(self.startup_time, "warmup_shapes"):
            max_pages = -(-self.max_model_len // PAGE_SIZE)
            plan = WarmupPlan.build(self.graphs.max_bs if self.graphs else 0,
                                    self.piecewise.buckets if self.piecewise else [], max_pages, PAGE_SIZE,
                                    self.cfg.index_topk)
            # every kernel preloaded and none loaded since: one core shape per class, not the row sweep
            preloaded = self.warm_start is not None and self.warm_start.covers(self._jit_loads())
        if deferred and not preloaded:  # the preload missed a kernel: the large eager steps warm as cold
            self._warmup_prefill()
        with _Timer(self.startup_time, "warmup_shapes"):
            cores = warm_core_shapes(self.piecewise, plan, self.max_model_len, preloaded) if self.piecewise else 0
            sampler = warm_sampler(self.device, self.cfg.vocab_size, tuple(self.cfg.eos_token_ids))
            self.warmed = {"decode_buckets": list(plan.decode), "piecewise_buckets": list(plan.piecewise),
                           "core_shapes": cores, "core_warmup": "per class (preloaded)" if preloaded else "row sweep",
                           "prefill_warmup": "skipped (preloaded)" if deferred and preloaded else "ran",
                           "sampler_variants": sampler}

    def _warmup_prefill(self) -> None:
        """The chunk size, and one step just over the piecewise buckets: large eager steps of either alignment
        class (Triton specialises integer arguments divisible by 16) compile before Up."""
        with _Timer(self.startup_time, "warmup"):
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
        """One rank whose preload loaded every recorded kernel: its prefill warmup can be left out (each rank's
        record hits or misses on its own, and that forward holds collectives: several ranks run it)."""
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
        runner.capture()
        return runner

    def _capture_decode(self) -> CudaGraphRunner:
        max_pages = -(-self.max_model_len // PAGE_SIZE)
        runner = CudaGraphRunner(self.model, self.kv_pool, self.cuda_graph_max_bs, max_pages, self.kv_pool.sink_page,
                                 self.future_token_ids, moe_gather=self._dp_gather_graphs)
        # its own pool, not the piecewise graphs': its logits outputs then live where no piecewise replay writes
        runner.capture()
        return runner

    def _load_tokenizer(self):
        """The checkpoint's tokenizer (offline Engine: prompts as text); the server's processes read their own."""
        if self.checkpoint is None or not (self.checkpoint / "tokenizer.json").exists():
            return None
        from tokenizers import Tokenizer

        path = self.checkpoint / "tokenizer.json"
        try:
            return Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type
            raise CheckpointError(f"{path}: not a valid tokenizer.json ({e})") from None

    # ---- steps -----------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] float32 for one scheduled step (a replayed decode step's
        may be a view of the graph's output: read them before the next forward). A host batch goes to the
        device here: into a graph runner's static inputs in one copy, or field by field for an eager step.
        Under overlap scheduling an input id -1-j is the token the step before sampled in row j
        (`future_token_ids[j]`), resolved on the device — inside the decode graph for a replay. Under
        DP-attention every rank calls this or `forward_idle()` once per step (they agree on the step first)."""
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
            return self.graphs.replay(batch, bucket)
        if route == "piecewise":
            return self.piecewise.forward(batch)
        if route == "eager_large":
            COUNTERS.add("eager_large_steps")
        elif route != "eager":
            COUNTERS.add(f"eager_fallbacks.{route.removeprefix('eager:')}")
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        if self.future_token_ids is not None:
            resolve_placeholders_(batch.input_ids, self.future_token_ids)
        if step is not None:
            batch = dataclasses.replace(batch, dp_rows=step.rows, dp_tokens=step.tokens)
        logits, _ = self.model(batch, self.kv_pool)
        return logits

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

    def _ledger_pool_prediction(self) -> dict:
        """The ledger's arithmetic for this pool, shown beside what was allocated (they must agree)."""
        from dsaserve.ledger.kv import indexer_bytes_per_token_layer, kv_bytes_per_token_layer

        layers = self.model.kv_layer_ids
        n_full = sum(self.cfg.is_full_indexer(i) for i in layers)
        per_token = (kv_bytes_per_token_layer(self.cfg, self.kv_pool.layout) * len(layers)
                     + indexer_bytes_per_token_layer(self.cfg, self.kv_pool.layout) * n_full)
        budget = self.profile.kv_budget_bytes if self.profile else None
        pages = budget // (per_token * PAGE_SIZE) if budget else self.kv_pool.num_pages
        return {"bytes_per_token": per_token, "pages": pages, "tokens": pages * PAGE_SIZE,
                "matches_pool": per_token == self.kv_pool.info().bytes_per_token and pages == self.kv_pool.num_pages}

    def manifest(self) -> dict:
        info = self.kv_pool.info()
        return {"model": self.cfg.name, "model_type": self.cfg.model_type, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "startup_time": dict(self.startup_time),
                "parallel": self.parallel.to_dict() | {"warmed_collectives": self.warmed_collectives}
                | ({"dp_moe": self.args.dp_moe} if self.dp_sync is not None else {}),
                "weights": self.load_report.to_dict(), "kv_pool": info.__dict__,
                "memory_profile": self.profile.to_dict() if self.profile else None,
                "kv_pool_ledger": self._ledger_pool_prediction(),
                "kernels": describe_kernels(self.device),
                "cuda_graph": {"buckets": sorted(self.graphs.graphs) if self.graphs else [],
                               "inputs_copied_in_graph": self.graphs.copy_in_graph if self.graphs else False,
                               "max_bs": self.cuda_graph_max_bs if self.graphs else 0,
                               "capture_seconds": round(self.graphs.capture_seconds, 3) if self.graphs else 0,
                               "error": self.graph_errors.get("decode")},
                "piecewise_cuda_graph": {
                    "buckets": sorted(self.piecewise.graphs) if self.piecewise else [],
                    "segments_per_bucket": self.model.num_segments if self.piecewise else 0,
                    "capture_seconds": round(self.piecewise.capture_seconds, 3) if self.piecewise else 0,
                    "pool_bytes": self.piecewise.capture_bytes if self.piecewise else 0,
                    "error": self.graph_errors.get("piecewise")},
                "warmed_prefill_chunks": self.warmed_prefill,
                "warmed_shapes": self.warmed,
                "compile_cache": self.compile_cache.report() if self.compile_cache else None,
                "kernel_precompile": self._precompile_report(),
                "warm_start": self.warm_start.report() if self.warm_start is not None else None,
                "early_cuda_context": early_cuda.report(),
                "env": envs.set_switches()}


    def _precompile_report(self) -> dict:
        """What the parallel precompile did: its report (wall_s ran beside init / load_weights; only
        `kernel_precompile_wait` is on this rank's path), and the spec list this start recorded."""
        rec = self.spec_recorder
        out: dict[str, Any] = {"status": "off" if not envs.DSASERVE_PRECOMPILE else "no spec list yet"}
        if kernel_precompile.skipped() is not None:  # every listed spec compiled by an earlier start
            out = dict(kernel_precompile.skipped())
        if self.precompile is not None:
            out = {"status": "ran", **(self.precompile.report or {})}
        if rec is not None:
            out["recorded_specs"], out["spec_list"] = len(rec.specs), str(rec.path)
        return out


def _init_method(args: EngineArgs) -> str | None:
    """--dist-init-addr host:port -> tcp://host:port (None: $MASTER_ADDR / $MASTER_PORT, env://)."""
    return f"tcp://{args.dist_init_addr}" if args.dist_init_addr else None
