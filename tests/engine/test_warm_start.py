"""engine/warm_start.py without a GPU: the fingerprint separates configurations (and ignores start-up-only
settings); a record preloads every spec into its JITFunction (a fake with Triton's `preload` contract: the
spec in, a kernel whose handles load out), a stale spec is counted and skipped, a missing record is a miss;
the forward warmup is reduced only when everything preloaded and nothing loaded since; the memory profile is
reused only on a hit with the same live values; the switch turns it all off; the reduced plan still reaches
every selection class of the full one."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dsaserve.common import envs
from dsaserve.engine import kernel_precompile as kp
from dsaserve.engine import warm_start as ws
from dsaserve.engine.warmup_plan import WarmupPlan


class _Kernel:
    def __init__(self) -> None:
        self.handles = 0

    def _init_handles(self) -> None:
        self.handles += 1


class _FakeJit:
    """Triton's JITFunction.preload contract: the serialised spec in, the kernel cached under its key, out."""

    def __init__(self, name: str) -> None:
        self.name, self.cache = name, {}

    def preload(self, spec: str) -> _Kernel:
        d = json.loads(spec)
        if d["name"] != self.name:
            raise RuntimeError(f"Specialization data is for {d['name']} but trying to preload for {self.name}")
        if d.get("broken"):
            raise KeyError("target")
        return self.cache.setdefault(d["key"], _Kernel())


_kernel_a = _FakeJit(f"{__name__}._kernel_a")


class _Wrapper:  # an autotuner-like wrapper: the JITFunction is its `fn`
    fn = _FakeJit(f"{__name__}._kernel_b")


_kernel_b = _Wrapper()


def _spec(name: str, key: str, **extra) -> str:
    return json.dumps({"name": f"{__name__}.{name}", "key": key, **extra})


@dataclasses.dataclass
class _Args:
    chunked_prefill_size: int = 2048
    dist_init_addr: str | None = None


@dataclasses.dataclass
class _Cfg:
    name: str = "glm-5.3-slice"


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.delenv("DSASERVE_WARM_START", raising=False)
    envs.reload()
    yield tmp_path
    envs.reload()


def _parts(**kw) -> dict:
    return ws.config_parts(_Args(**kw), _Cfg(), {"rank": 0}, {"gpu": "H200", "total_memory": 1 << 37})


def test_the_fingerprint_separates_configurations_but_not_start_only_settings(monkeypatch):
    base = ws.fingerprint(_parts())
    assert base == ws.fingerprint(_parts())
    assert base != ws.fingerprint(_parts(chunked_prefill_size=4096))
    assert base == ws.fingerprint(_parts(dist_init_addr="10.0.0.1:29500"))  # a rendezvous port per start
    assert base != ws.fingerprint({**_parts(), "gpu": "H100"})
    monkeypatch.setenv("DSASERVE_CACHE_DIR", "/elsewhere")
    envs.reload()
    assert ws.fingerprint(_parts()) == base
    monkeypatch.setenv("DSASERVE_PDL", "0")  # a kernel switch: other kernels
    envs.reload()
    assert ws.fingerprint(_parts()) != base
    monkeypatch.delenv("DSASERVE_PDL")
    envs.reload()
    assert len(ws.code_version()) == 16


def test_no_record_is_a_miss_and_the_forward_warmup_runs(root):
    w = ws.WarmStart(_parts(), root)
    assert w.preload(lambda: 0)["status"] == "miss"
    assert not w.covers(0)
    assert w.cached_profile({"total_bytes": 1}) is None


def test_a_saved_record_preloads_every_spec_and_covers_the_warmup(root):
    specs = [_spec("_kernel_a", "k1"), _spec("_kernel_a", "k2"), _spec("_kernel_b", "k3")]
    first = ws.WarmStart(_parts(), root)
    first.preload(lambda: 0)
    assert first.save(specs, {"total_bytes": 10, "kv_budget_bytes": 3}) is True
    assert first.save(specs, None) is False  # the same specs: nothing rewritten

    loads = [7]
    again = ws.WarmStart(_parts(), root)
    report = again.preload(lambda: loads[0])
    assert report["status"] == "hit" and report["specs"] == 3 and report["failed"] == 0
    assert set(_kernel_a.cache) >= {"k1", "k2"} and "k3" in _Wrapper.fn.cache
    assert all(k.handles >= 1 for k in [*_kernel_a.cache.values(), *_Wrapper.fn.cache.values()])
    assert again.covers(7)
    assert not again.covers(8)  # something loaded after the preload: the record missed it
    assert again.report()["preload"]["loaded_after_preload"] == 1
    # another configuration has its own record
    assert ws.WarmStart(_parts(chunked_prefill_size=64), root).preload(lambda: 0)["status"] == "miss"


def test_a_stale_spec_is_counted_and_skipped_and_the_record_is_replaced(root):
    good, stale = _spec("_kernel_a", "k9"), _spec("_kernel_a", "k10", broken=True)
    gone = json.dumps({"name": "dsaserve.no_such_module._kernel", "key": "x"})
    ws.WarmStart(_parts(), root).save([good, stale, gone, "{torn"], None)
    w = ws.WarmStart(_parts(), root)
    report = w.preload(lambda: 0)
    assert report["status"] == "partial" and report["failed"] == 2 and report["specs"] == 3
    assert "k9" in _kernel_a.cache  # the others still preloaded
    assert not w.covers(0)
    assert w.save([good], None) is True  # this start's own specs: the stale ones dropped
    assert kp.read_specs([w.specs_path]) == [good]


def test_the_memory_profile_is_reused_only_on_a_hit_with_the_same_live_values(root):
    live = {"total_bytes": 100, "weights_bytes": 40, "mem_fraction_static": 0.88, "graph_reserve_bytes": 1}
    profile = {**live, "peak_activation_bytes": 5, "kv_budget_bytes": 30}
    first = ws.WarmStart(_parts(), root)
    assert first.cached_profile(live) is None  # no preload hit
    first.save([_spec("_kernel_a", "p1")], profile)

    w = ws.WarmStart(_parts(), root)
    w.preload(lambda: 0)
    assert w.cached_profile({**live, "weights_bytes": 41}) is None
    assert w.profile_status == "miss (changed: weights_bytes)"
    assert w.cached_profile(live) == profile and w.profile_status == "hit"
    assert w.report()["memory_profile"] == "hit"
    mtime = w.profile_path.stat().st_mtime_ns
    w.save([_spec("_kernel_a", "p1")], profile)
    assert w.profile_path.stat().st_mtime_ns == mtime  # a hit is not rewritten


def test_the_switch_turns_the_warm_start_off(root, monkeypatch):
    ws.WarmStart(_parts(), root).save([_spec("_kernel_a", "o1")], {"total_bytes": 1})
    monkeypatch.setenv("DSASERVE_WARM_START", "0")
    envs.reload()
    w = ws.WarmStart(_parts(), root)
    assert w.preload(lambda: 0)["status"] == "off" and not w.covers(0)
    assert w.cached_profile({"total_bytes": 1}) is None and w.report()["memory_profile"] == "off"
    assert w.save([_spec("_kernel_a", "o2")], None) is False


def test_the_recorder_appends_specs_seen_after_save_to_its_mirrors(tmp_path):
    rec = kp.SpecRecorder(tmp_path / "list.jsonl")
    rec.add(_spec("_kernel_a", "m1"))
    rec.save()
    rec.mirrors += [tmp_path / "record.jsonl", tmp_path / "missing" / "dir" / "record.jsonl"]
    rec.add(_spec("_kernel_a", "m2"))  # an unwritable mirror is skipped, not raised inside a launch
    assert kp.read_specs([tmp_path / "record.jsonl"]) == [_spec("_kernel_a", "m2")]
    assert kp.read_specs([rec.path]) == [_spec("_kernel_a", "m1"), _spec("_kernel_a", "m2")]


@pytest.mark.parametrize("max_tokens,max_pages,topk", [(576, 3168, 2048), (576, 64, 8)])
def test_the_per_class_shapes_reach_every_selection_class_of_the_full_plan(max_tokens, max_pages, topk):
    plan = WarmupPlan.build(64, [8, 16, 32, max_tokens], max_pages, 64, topk)
    assert set(plan.class_shapes) <= set(plan.core_shapes)
    assert len(plan.class_shapes) < len(plan.core_shapes) / 10
    select = {plan.core_class(n, w)[1] for n, w in plan.core_shapes}
    assert {plan.core_class(n, w)[1] for n, w in plan.class_shapes} == select


def test_the_runner_records_at_up_and_the_next_start_preloads_and_reuses_its_profile(root, monkeypatch):
    """The ModelRunner's wiring (CUDA-only at start-up) driven on a CPU runner: a first start misses, records
    its specs and profile at Up; the next start of the same configuration preloads them and takes the profile."""
    from dsaserve.engine import model_runner as mr
    from dsaserve.engine import runner_startup
    from dsaserve.engine.memory_profile import MemoryProfile

    triton = pytest.importorskip("triton")
    knobs = triton.knobs
    monkeypatch.setenv("DSASERVE_CACHE_DIR", str(root / "cache"))
    envs.reload()
    monkeypatch.setattr(runner_startup, "device_parts", lambda device: {"gpu": "fake", "total_memory": 100})
    monkeypatch.setattr(mr.torch.cuda, "mem_get_info", lambda device=None: (60, 100))
    monkeypatch.setattr(mr.torch.cuda, "memory_allocated", lambda device=None: 40)
    previous = knobs.runtime.jit_post_compile_hook
    try:
        r = mr.ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", num_pages=8)
        r.kernel_loads, r.spec_recorder = mr.KernelLoads(), kp.SpecRecorder(root / "list.jsonl")
        r.warm_start = r._preload()
        assert r.warm_start.report()["status"] == "miss" and "kernel_preload" in r.startup_time
        assert r._cached_profile() is None
        r.profile = MemoryProfile(100, 40, 5, 1 << 30, 0.88, 30)
        spec = _spec("_kernel_a", "runner")
        knobs.runtime.jit_post_compile_hook(compile={"specialization_data": spec})  # the JIT loaded a kernel
        r._save_warm_start()
        assert kp.read_specs([r.warm_start.specs_path]) == [spec]

        r.warm_start = r._preload()  # the next start of the same configuration
        assert r.warm_start.report()["preload"]["status"] == "hit"
        assert r.warm_start.covers(r._jit_loads())
        assert r._cached_profile() == r.profile and r.warm_start.report()["memory_profile"] == "hit"
        r.graph_errors["piecewise"] = "capture failed"  # a start that fell back to eager records nothing
        r.warm_start.specs_path.unlink()
        r._save_warm_start()
        assert not r.warm_start.specs_path.exists()
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_triton_key_is_computed_on_a_thread():
    pytest.importorskip("triton")
    from triton.runtime.cache import triton_key

    thread = ws.prewarm_triton_key()
    assert thread is not None
    thread.join()
    hits = triton_key.cache_info().hits
    assert triton_key() and triton_key.cache_info().hits == hits + 1  # the caller's first use: already there


def test_triton_key_thread_is_started_once_and_the_preload_waits_for_it(monkeypatch):
    pytest.importorskip("triton")
    first = ws.prewarm_triton_key()
    assert ws.prewarm_triton_key() is first  # the scheduler's early start and ModelRunner's call share it
    joined = []
    monkeypatch.setattr(first, "join", lambda: joined.append(True))
    ws._await_triton_key()
    assert joined == [True]
