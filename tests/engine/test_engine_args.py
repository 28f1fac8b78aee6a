"""EngineArgs' parallel flags follow the one copy of the layout rules (distributed/layout.py check_sizes),
with errors that name the engine's flags; `initialize_model_parallel` refuses the same layouts by argument
name, before any rendezvous."""

from __future__ import annotations

import pytest

from dsaserve.distributed.parallel_state import initialize_model_parallel
from dsaserve.engine.engine_args import EngineArgs


@pytest.mark.parametrize(("kw", "msg"), [
    ({"tensor_parallel_size": 0}, "--tensor-parallel-size: must be a positive integer, got 0"),
    ({"tensor_parallel_size": 2, "expert_parallel_size": 4}, "--tensor-parallel-size 2: must be 1 or the world size 4"),
    ({"tensor_parallel_size": 4, "expert_parallel_size": 3}, "--expert-parallel-size 3: does not divide"),
    ({"enable_dp_attention": True}, r"--enable-dp-attention: needs several ranks .*--expert-parallel-size N"),
    ({"enable_dp_attention": True, "tensor_parallel_size": 2}, "needs --expert-parallel-size = the world size 2"),
    ({"moe_a2a": True, "tensor_parallel_size": 2}, "--moe-a2a: .* needs --expert-parallel-size = the world size 2"),
    ({"moe_a2a": 1, "expert_parallel_size": 2}, "--moe-a2a: must be a boolean"),
    ({"tensor_parallel_size": 2, "nnodes": 3}, "--nnodes: 3 does not divide the 2 ranks"),
])
def test_a_bad_parallel_layout_is_refused_naming_the_flag(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EngineArgs(model="glm-5.3-tiny", **kw)


def test_good_layouts_pass_and_give_the_world_size():
    assert EngineArgs(model="glm-5.3-tiny", expert_parallel_size=4, enable_dp_attention=True).world_size == 4
    assert EngineArgs(model="glm-5.3-tiny", tensor_parallel_size=2, expert_parallel_size=2, moe_a2a=True,
                      nnodes=2, dist_init_addr="h:1").world_size == 2


def test_model_parallel_refuses_all_to_all_moe_without_ep_the_world_before_a_rendezvous():
    with pytest.raises(ValueError, match="--moe-a2a: .* needs ep_size = the world size 2, got ep_size 1"):
        initialize_model_parallel(tp_size=2, moe_a2a=True)


@pytest.mark.parametrize("value", [-3, True, 2.5])
def test_mixed_step_tokens_below_zero_is_refused(value):
    """A negative cap made every step with decodes schedule no prefill: new requests waited for the decodes."""
    with pytest.raises(ValueError, match="--mixed-step-tokens: must be an integer >= 0"):
        EngineArgs(model="glm-5.3-tiny", mixed_step_tokens=value)
    assert EngineArgs(model="glm-5.3-tiny", mixed_step_tokens=0).resolved_mixed_step_tokens() == 0


def test_a_missing_precompile_schemas_file_is_refused_before_the_load(tmp_path):
    """It failed after the weights, the memory profile and the graphs: minutes into a start on a GPU."""
    with pytest.raises(ValueError, match=r"--precompile-schemas: .*nope.json is not a file"):
        EngineArgs(model="glm-5.3-tiny", precompile_schemas=str(tmp_path / "nope.json"))
    (tmp_path / "s.json").write_text("[]")
    assert EngineArgs(model="glm-5.3-tiny", precompile_schemas=str(tmp_path / "s.json")).precompile_schemas


def test_max_model_len_past_the_models_positions_is_refused():
    from dsaserve.config import load_config

    cfg = load_config("glm-5.3-tiny")
    EngineArgs(model="glm-5.3-tiny", max_model_len=cfg.max_position_embeddings).check_layout(cfg)
    with pytest.raises(ValueError, match="--max-model-len: .* exceeds the model's max_position_embeddings"):
        EngineArgs(model="glm-5.3-tiny", max_model_len=cfg.max_position_embeddings + 1).check_layout(cfg)


def test_cuda_on_a_machine_without_a_gpu_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine has
    with pytest.raises(ValueError, match="--device: cuda, but torch .* finds no CUDA device"):
        EngineArgs(model="glm-5.3-tiny", device="cuda").check_device()
    EngineArgs(model="glm-5.3-tiny", device="cpu").check_device()


def test_a_model_past_the_hosts_memory_is_refused_on_the_cpu_before_any_weight():
    """GLM-5.3 in float32 is ~3 TB: refused at once instead of growing until the kernel kills the process."""
    from dsaserve.config import load_config

    cfg = load_config("glm-5.3")
    with pytest.raises(ValueError, match=r"--model glm-5.3: its 743.4 B weights need \d+ GB of host memory"):
        EngineArgs(model="glm-5.3", device="cpu", load_format="dummy").check_layout(cfg)
    with pytest.raises(ValueError, match=r"its 753.3 B weights"):  # with the MTP layer, which is built only if asked
        EngineArgs(model="glm-5.3", device="cpu", load_format="dummy", load_mtp=True).check_layout(cfg)
    EngineArgs(model="glm-5.3-tiny", device="cpu").check_layout(load_config("glm-5.3-tiny"))
