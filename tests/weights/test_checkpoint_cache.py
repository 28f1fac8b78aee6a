"""resolve_checkpoint: directories as is, built-in names cached once (atomically, under a lock), clear refusals."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from dsaserve.config import load_config
from dsaserve.weights import checkpoint_cache
from dsaserve.weights.checkpoint_cache import CheckpointResolveError, resolve_checkpoint
from dsaserve.weights.checkpoint_writer import INDEX_FILE, write_checkpoint


@pytest.fixture
def cache(tmp_path, set_switch):
    set_switch("DSASERVE_CACHE_DIR", str(tmp_path / "cache"))
    set_switch("DSASERVE_MAX_CHECKPOINT_GB", None)
    return tmp_path / "cache"


@pytest.fixture
def count_writes(monkeypatch):
    calls = []
    real = checkpoint_cache.write_checkpoint

    def counting(*a, **kw):
        calls.append(a[0].name)
        return real(*a, **kw)

    monkeypatch.setattr(checkpoint_cache, "write_checkpoint", counting)
    return calls


def test_builtin_name_is_written_once_under_the_cache_dir(cache, count_writes):
    first, again = {}, {}
    path = resolve_checkpoint("glm-5.3-tiny", first)
    assert path == cache / "checkpoints" / "glm-5.3-tiny-seed0"
    assert first == {"kind": "checkpoint", "status": "miss", "path": str(path)}  # what the manifest says
    assert (path / INDEX_FILE).is_file() and (path / "tokenizer.json").is_file()
    assert load_config(path).to_hf_dict() == load_config("glm-5.3-tiny").to_hf_dict()
    mtime = (path / INDEX_FILE).stat().st_mtime_ns
    assert resolve_checkpoint("glm-5.3-tiny", again) == path
    assert again == {"kind": "checkpoint", "status": "hit", "path": str(path)}
    assert count_writes == ["glm-5.3-tiny"]
    assert (path / INDEX_FILE).stat().st_mtime_ns == mtime
    assert not [p for p in (cache / "checkpoints").iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_cached_checkpoint_equals_make_checkpoint_with_seed_0(cache, tmp_path):
    path = resolve_checkpoint("deepseek-v3.2-tiny")
    direct = write_checkpoint(load_config("deepseek-v3.2-tiny"), tmp_path / "direct", seed=0)
    for f in direct.iterdir():
        assert (path / f.name).read_bytes() == f.read_bytes(), f.name


def test_concurrent_resolvers_write_it_once(cache, count_writes):
    barrier = threading.Barrier(4)

    def go(_):
        barrier.wait()
        return resolve_checkpoint("deepseek-v3.2-tiny")

    with ThreadPoolExecutor(4) as pool:
        paths = set(pool.map(go, range(4)))
    assert paths == {cache / "checkpoints" / "deepseek-v3.2-tiny-seed0"}
    assert count_writes == ["deepseek-v3.2-tiny"]


def test_a_stale_cached_copy_is_rebuilt(cache, count_writes):
    path = resolve_checkpoint("deepseek-v3.2-tiny")
    cfg_text = (path / "config.json").read_text()
    edited = json.loads(cfg_text)
    edited["index_topk"] = 4  # as if the built-in config changed since the cache was written
    (path / "config.json").write_text(json.dumps(edited))
    (path / "model-00099-of-00099.safetensors").write_text("left over")
    assert resolve_checkpoint("deepseek-v3.2-tiny") == path
    assert (path / "config.json").read_text() == cfg_text
    assert not (path / "model-00099-of-00099.safetensors").exists()
    assert len(count_writes) == 2


def test_a_checkpoint_directory_is_returned_as_is(cache, tmp_path, count_writes):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text("{}")
    said = {}
    assert resolve_checkpoint(str(d), said) == d
    assert count_writes == [] and said["status"] == "not cached"


def test_dummy_weights_cache_the_config_and_tokenizer_and_say_so(cache, count_writes):
    first, again = {}, {}
    path = checkpoint_cache.resolve_model_dir("glm-5.3-tiny", "dummy", first)
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file() and count_writes == []
    assert checkpoint_cache.resolve_model_dir("glm-5.3-tiny", "dummy", again) == path
    assert (first["kind"], first["status"], again["status"]) == ("config_and_tokenizer", "miss", "hit")


def test_a_directory_without_config_json_is_named(cache, tmp_path):
    with pytest.raises(CheckpointResolveError, match=f"{tmp_path}.*no config.json"):
        resolve_checkpoint(str(tmp_path))


def test_an_unknown_model_value_is_named_with_the_builtin_choices(cache):
    with pytest.raises(CheckpointResolveError, match="'not-a-model'.*glm-5.3-tiny"):
        resolve_checkpoint("not-a-model")


def test_full_size_builtins_are_refused_pointing_at_dummy_weights(cache):
    with pytest.raises(CheckpointResolveError, match=r"'glm-5.3'.*7\d\d\.\d GB.*--load-format dummy"):
        resolve_checkpoint("glm-5.3")
    assert not (cache / "checkpoints" / "glm-5.3-seed0").exists()


def test_the_size_limit_is_configurable(cache, set_switch):
    set_switch("DSASERVE_MAX_CHECKPOINT_GB", "0.001")
    with pytest.raises(CheckpointResolveError, match="glm-5.3-tiny.*DSASERVE_MAX_CHECKPOINT_GB"):
        resolve_checkpoint("glm-5.3-tiny")
    set_switch("DSASERVE_MAX_CHECKPOINT_GB", "lots")
    with pytest.raises(CheckpointResolveError, match="DSASERVE_MAX_CHECKPOINT_GB.*'lots'"):
        resolve_checkpoint("glm-5.3-tiny")
