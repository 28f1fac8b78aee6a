"""dsaserve: an inference engine for DSA-MoE models (GLM-5.x `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`).

`from dsaserve import Engine, SamplingParams` imports the engine lazily, so `dsaserve ledger` and
`import dsaserve` never pay for torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Engine": "dsaserve.engine.engine",
    "RequestOutput": "dsaserve.engine.engine",
    "CompletionOutput": "dsaserve.engine.engine",
    "SamplingParams": "dsaserve.common.sampling_params",
    "EngineArgs": "dsaserve.engine.engine_args",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dsaserve' has no attribute {name!r}")
