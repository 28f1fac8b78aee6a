"""Report section on speculative decoding with the MTP layer: one decode step's time and the time a generated token
costs against the drafts a request verifies, at the assumed acceptance, with the acceptance each needs to pay.

Owns: turning speculative.py's forwards (through marginal.decode_step) into a `Section`. Request-path stage: 7.
Pure Python.
"""

from __future__ import annotations

from dataclasses import replace

from dsaserve.ledger.deployment import MAX_DRAFTS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.marginal import DecodeStep, decode_step
from dsaserve.ledger.report import Column, Section
from dsaserve.ledger.speculative import acceptance, break_even_acceptance, drafts


def step_with(li: LedgerInputs, k: int, acceptance: float | None = None) -> DecodeStep:
    """The workload's decode step verifying k drafts a request (0: plain decoding, the MTP layer not run), at the
    assumed acceptance or the one given."""
    asm = replace(li.asm, speculative=k > 0, speculative_num_steps=max(k, 1))
    if acceptance is not None:
        asm = replace(asm, draft_acceptance=acceptance, draft_acceptance_by_position="")
    return decode_step(li.cfg, li.inv, li.dep, li.hw, asm, li.work.kv_layout, li.work.batch, li.work.decode_context)


def speculative(li: LedgerInputs) -> Section:
    steps = {k: step_with(li, k) for k in range(MAX_DRAFTS + 1)}
    plain = steps[0].serial_s
    rows = []
    for k, st in steps.items():
        per_token = st.serial_s / st.tokens_per_request
        even = break_even_acceptance(lambda a, k=k: step_with(li, k, a).serial_s / plain, k) if k else None
        rows.append({"drafts": k, "verify_tokens": k + 1, "mtp_forwards": k, "step_s": st.serial_s,
                     "step_ratio": st.serial_s / steps[0].serial_s, "tokens": st.tokens_per_request,
                     "per_token_s": per_token, "tokens_s": st.batch / per_token, "speedup": plain / per_token,
                     "break_even": even,
                     "why": "plain decoding" if not k else "pays at any acceptance from the break-even on"
                     if even is not None else "the verify costs more than k + 1 plain steps: never pays"})
    cols = [Column("drafts", "drafts a request"), Column("verify_tokens", "tokens verified a request"),
            Column("mtp_forwards", "MTP forwards"), Column("step_s", "step (serial)", "s"),
            Column("step_ratio", "step / plain step", "x"), Column("tokens", "tokens a request a step"),
            Column("per_token_s", "time between a request's tokens", "s"),
            Column("tokens_s", "tokens/s (the batch)"), Column("speedup", "speedup", "x"),
            Column("break_even", "break-even acceptance"), Column("why", "why")]
    now, rates = drafts(li.asm), acceptance(li.asm)
    assumed = (f"acceptance {rates[0]:g} at every position (draft_acceptance)" if len(rates) == 1 else
               f"acceptance {', '.join(f'{r:g}' for r in rates)} at positions 1-{len(rates)}, the last past it "
               "(draft_acceptance_by_position; the break-even is one rate at every position)")
    return Section("speculative", f"Speculative decoding with the MTP layer: batch {li.work.batch}, context "
                   f"{li.work.decode_context:,}", f"{assumed}; " + (f"the engine verifies {now} drafts a request"
                   if now else "speculation is off (--speculative-num-steps K turns it on)"), cols, rows,
                   ["a step verifying k drafts: the main model over 1 + k tokens a request, the MTP layer over the "
                    "kept positions, then k - 1 chained draft forwards of one token a request (engine/mtp.py); each "
                    "reads the MTP layer and the lm_head it shares",
                    "tokens a request a step = 1 + a1 + a1 a2 + ... (one rate: 1 + a + ... + a^k); the speedup is the "
                    "plain step's time a token over this one's; chained drafts are usually kept less often than the "
                    "first: --draft-acceptance A1,A2,... takes a run's rates (bench_speculative.py, Prometheus "
                    "dsaserve_spec_decode_num_accepted_tokens_per_pos)"])
