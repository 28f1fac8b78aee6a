"""What the scheduler reports and how its bookkeeping is audited (stage 3 and 10's observability).

Owns: `scheduler_stats` (the level and counter snapshot behind `EngineCore.stats()` and Prometheus: requests,
KV pages used / cached / free / total, the scheduler's counters), the speculative-decoding counters (`count_drafts`,
`count_kept`: drafts verified, request-steps that verified any, drafts kept by position — vLLM's
`spec_decode_num_accepted_tokens_per_pos`, whose ratio to the drafts is the acceptance at each position, what
`dsaserve ledger --draft-acceptance` asks) and `check_no_leak` (the tests' and the
engine's end-of-run audit: every page free or held only by the prefix cache, no request or page-table row
left). Read-only over a `Scheduler`; torch-free, like it.
"""

from __future__ import annotations

from typing import Any


def scheduler_stats(s: Any) -> dict:
    """The scheduler's levels and counters. used + cached + free == total; in_prefix_cache overlaps used (live
    requests share cached pages)."""
    free, evictable = s.alloc.num_free, s.cache.num_evictable
    return {
        "num_running": len(s.running),
        "num_waiting": len(s.waiting),
        "kv_pages_total": s.cfg.num_pages,
        "kv_pages_used": s.cfg.num_pages - free - evictable,
        "kv_pages_cached": evictable,
        "kv_pages_free": free,
        "kv_pages_in_prefix_cache": s.cache.num_cached,
        "evicted_pages": s.cache.evicted_pages,
        **{k: list(v) if isinstance(v, list) else v for k, v in s.counters.items()},  # a snapshot, not a view
    }


def spec_counters() -> dict[str, Any]:
    """The speculative-decoding counters at zero: `spec_accepted_per_pos[j]` counts drafts kept at position j + 1."""
    return {"spec_draft_tokens": 0, "spec_num_drafts": 0, "spec_accepted_tokens": 0, "spec_accepted_per_pos": []}


def count_drafts(counters: dict[str, Any], drafts: list[int]) -> None:
    """A step verified `drafts[i]` drafts of its i-th drafting request (live ones)."""
    counters["spec_draft_tokens"] += sum(drafts)
    counters["spec_num_drafts"] += sum(1 for n in drafts if n)


def count_kept(counters: dict[str, Any], pos: int) -> None:
    """The draft at 0-based position `pos` of a request's step was kept."""
    per = counters["spec_accepted_per_pos"]
    per.extend([0] * (pos + 1 - len(per)))
    per[pos] += 1
    counters["spec_accepted_tokens"] += 1


def check_no_leak(s: Any) -> None:
    """AssertionError unless every page is free or held only by the prefix cache, and nothing is left."""
    problems = []
    if s.running or s.waiting or s.groups or s.prompt_lp_groups:
        problems.append(f"requests left: running={s.running} waiting={list(s.waiting)} "
                        f"groups={list(s.groups)} asking prompt logprobs={s.prompt_lp_groups}")
    held = [p for p in range(s.cfg.num_pages) if s.alloc.refcount(p)]
    if held:
        problems.append(f"{len(held)} pages still referenced: {held[:16]}")
    free, evictable = s.alloc.free_set(), s.cache.evictable_pages()
    if len(free) != s.alloc.num_free:
        problems.append("a page is on the free list twice")
    if free & evictable or len(free) + len(evictable) != s.cfg.num_pages:
        problems.append(f"free ({len(free)}) + evictable ({len(evictable)}) != {s.cfg.num_pages} pages")
    if sorted(s.rows.free) != list(range(s.cfg.max_running_requests)) or s.reserved_rows:
        problems.append(f"page-table rows leaked: {s.cfg.max_running_requests - len(s.rows.free)} "
                        f"held, {s.reserved_rows} reserved")
    if problems:
        raise AssertionError("KV leak: " + "; ".join(problems))
