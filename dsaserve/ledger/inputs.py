"""LedgerInputs: the model, deployment, hardware, workload and assumptions of one report, bundled.

Owns: resolving the inputs once (config, weight inventory, weights per GPU) and the shortcuts every
section builder uses (`step(b, ctx)`, `prefill(...)`), so section code stays one concept each. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from dsaserve.config import ModelConfig
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import Hardware
from dsaserve.ledger.kv import KVCapacity, KVPerToken, kv_capacity, kv_per_token
from dsaserve.ledger.marginal import DecodeStep, decode_step
from dsaserve.ledger.prefill import Prefill, chunked_prefill
from dsaserve.ledger.weights import WeightInventory, inventory, stored_per_gpu


@dataclass
class LedgerInputs:
    cfg: ModelConfig
    dep: Deployment
    hw: Hardware
    work: Workload = field(default_factory=Workload)
    asm: Assumptions = field(default_factory=Assumptions)

    def __post_init__(self) -> None:
        self.dep.validate_for(self.cfg)

    @cached_property
    def inv(self) -> WeightInventory:
        return inventory(self.cfg)

    @cached_property
    def weights_per_gpu(self) -> float:
        return sum(stored_per_gpu(self.inv, self.dep, self.asm).values())

    @cached_property
    def kv(self) -> KVPerToken:
        return kv_per_token(self.cfg, self.work.kv_layout, self.asm)

    def capacity(self, context: int | None = None) -> KVCapacity:
        return kv_capacity(self.cfg, self.dep, self.hw, self.work, self.asm, self.weights_per_gpu, context)

    def step(self, batch: int, context: int) -> DecodeStep:
        return decode_step(self.cfg, self.inv, self.dep, self.hw, self.asm, self.work.kv_layout, batch, context)

    def prefill(self, context: int | None = None, start: int = 0) -> Prefill:
        return chunked_prefill(self.cfg, self.inv, self.dep, self.hw, self.asm, self.work, context, start)

    @property
    def name(self) -> str:
        return self.cfg.name or self.cfg.model_type
