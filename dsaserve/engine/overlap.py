"""Overlap scheduling: the host prepares step N+1 while the device still runs step N (SGLang's overlap
scheduler, vLLM v1's async scheduling; request path stages 3-10, issue 16).

Owns: the protocol, and the device side of the placeholder a sampled token has on the host while it is still
on the device (`request.placeholder`: -1-j for sample row j): its resolution into input ids. The step
order, `EngineCore.step`'s:

    schedule N+1 -> build N+1 -> launch forward N+1          (the device is still busy with step N)
    -> resolve N: wait for step N's tokens (copied to pinned memory behind an event), replace their
       placeholders, stop checks, deltas                     (the device runs forward N+1 meanwhile)
    -> sample N+1 on the device (grammar bitmasks, penalties and min_tokens see every token up to N)
    -> `Scheduler.launched`: tokens of N+1 in KV, each sample gets a placeholder -1-j (sample row j)
    -> the sampled tokens go to the runner's `future_token_ids[j]`, their host copy starts

A placeholder never reaches the host's text: when step N+1 is scheduled, the only placeholders are step N's
(every older one was resolved before step N was sampled), so an input id -1-j of step N+1 reads
`future_token_ids[j]`, which step N's sampling wrote. Pages and prefix-cache hashes only ever cover
tokens known on the host (a placeholder is never inside a full page that is registered).

What overlap costs: a sample that finished at step N (a stop token, found when N resolves) was already
in step N+1's batch. Its forward row is wasted and its pages are freed while step N+1 may still write
into them — safe, since every later user of a page is queued behind step N+1 on the same stream; it is not
sampled at N+1 (`Scheduler.live_samples`) and nothing of it is emitted or counted. A sample whose last
token reaches max_tokens / the context is known to end without its value, so it is not scheduled again.
An abort frees the pages at once and the token still on its way is dropped. Counted as
`overlap_discarded_tokens`; `overlap_steps` counts the steps launched ahead of their predecessor's tokens.

Speculative decoding (engine/mtp.py) steps without overlap scheduling but uses the same buffer and resolution for
its drafts: `future_token_ids[g]` is the g-th draft of the last step, and a verify row's input id -1-g reads it.
"""

from __future__ import annotations

import torch

from dsaserve.kernels.registry import get_ops


def resolve_placeholders_(input_ids: torch.Tensor, future_token_ids: torch.Tensor) -> None:
    """In place, on the device: every input id -1-j becomes future_token_ids[j]; real ids (>= 0) stay.
    No host sync and no data-dependent shape, so it is captured into the CUDA graphs as it is (one Triton
    launch on the GPU, `reference.resolve_placeholders`' torch ops elsewhere)."""
    get_ops(input_ids.device).resolve_placeholders(input_ids, future_token_ids)
