"""build_report: run every section builder for one set of inputs and collect a `Report`.

Owns: the order and the stable keys of the report's sections (the `--json` top-level "sections" keys),
and which of them a `--sections` selection keeps. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable

from dsaserve.ledger import sections_memory as mem
from dsaserve.ledger import sections_prefill as pre
from dsaserve.ledger import sections_step as step
from dsaserve.ledger.deployment import Assumptions
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.report import Report, Section
from dsaserve.ledger.sections_notes import notes_check
from dsaserve.ledger.sections_speculative import speculative
from dsaserve.ledger.units import CONVENTIONS

# key -> builder; the prefill builders share one computed Prefill (see build_report)
SECTIONS: dict[str, Callable[..., Section]] = {
    "model_constants": mem.model_constants,
    "weights_per_gpu": mem.weights_per_gpu,
    "kv_bytes": mem.kv_bytes,
    "kv_capacity": mem.kv_capacity,
    "kv_capacity_vs_context": mem.kv_capacity_vs_context,
    "scheduler_pages": mem.scheduler_pages,
    "timeline": step.timeline,
    "operators": step.operators,
    "collectives": step.collectives,
    "bytes_to_time": step.bytes_to_time,
    "decode_step": step.decode_step,
    "marginal_vs_batch": step.marginal_vs_batch,
    "marginal_vs_context": step.marginal_vs_context,
    "switch_points": step.switch_point_section,
    "speculative": speculative,
    "prefill_chunks": pre.prefill_chunks,
    "prefill_totals": pre.prefill_totals,
    "pd_transfer": pre.pd_transfer,
    "first_request": pre.first_request,
    "notes_check": lambda li: notes_check(),
}
_NEEDS_PREFILL = ("prefill_chunks", "prefill_totals")


def model_summary(li: LedgerInputs) -> dict[str, object]:
    c = li.cfg
    return {"name": li.name, "model_type": c.model_type, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers, "full_indexer_layers": len(c.full_indexer_layers),
            "moe_layers": len(c.moe_layers), "n_routed_experts": c.n_routed_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "vocab_size": c.vocab_size}


def build_report(li: LedgerInputs, sections: list[str] | None = None, with_notes: bool | None = None) -> Report:
    """All sections (or the named ones). `notes_check` is included by default only for GLM-5.3, the model
    the notes describe; `with_notes=True` forces it (it always checks GLM-5.3)."""
    wanted = list(sections) if sections else [k for k in SECTIONS if k != "notes_check"]
    unknown = [k for k in wanted if k not in SECTIONS]
    if unknown:
        raise ValueError(f"--sections: {unknown[0]!r} unknown (one of {', '.join(SECTIONS)})")
    if with_notes is None:
        with_notes = _is_builtin_glm53(li.cfg) and not sections
    if with_notes and "notes_check" not in wanted:
        wanted.append("notes_check")
    p = li.prefill() if any(k in wanted for k in _NEEDS_PREFILL) else None
    out = [SECTIONS[k](li, p) if k in _NEEDS_PREFILL else SECTIONS[k](li) for k in wanted]
    assumptions = li.asm.to_dict() | {"_why": Assumptions.describe()}
    return Report(dict(CONVENTIONS), model_summary(li), li.dep.to_dict(), li.hw.to_dict(), li.work.to_dict(),
                  assumptions, out, mem.memory_warnings(li) + li.dep.warnings())


def _is_builtin_glm53(cfg) -> bool:
    """The notes describe the built-in GLM-5.3 itself: a file that is only named so (`glm-5.3.json` with other
    values) is not it."""
    from dsaserve.config import load_config

    return cfg.name == "glm-5.3" and cfg.to_hf_dict() == load_config("glm-5.3").to_hf_dict()
