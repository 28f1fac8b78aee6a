"""PromptEntryCache: prompt logprobs (engine/prompt_logprobs.py) kept per full prompt page, so that a request whose
leading pages were scored before takes their entries instead of computing them, and with them the prefix cache's
KV for all but the last of those pages. lm-eval-harness's multiple-choice requests share their context this way
(vLLM computes it for every choice).

Invariant (with `Req.cacheable_tokens`): entries for targets [0, e x page) mark positions up to e x page - 1 asked,
so the prefix cache serves at most e - 1 pages; position e x page - 1, whose logits give page e's first target, is
computed. Scheduler-side and torch-free, like the scheduler.
"""

from __future__ import annotations

from collections import OrderedDict

from dsaserve.engine.prefix_cache import PrefixCache, token_bytes

# what the cache keeps, in (token, logprob) pairs, LRU: ~120 B each in Python, so ~120 MB of the scheduler process
# at most; 512K prompt tokens' entries at top-1 (lm-eval's), 50K at top-20
ENTRY_CACHE_PAIRS = 1 << 20


class PromptEntryCache:
    """The entries of full prompt pages, keyed by the prefix cache's chain key of the page (an entry depends on the
    tokens up to its own): a request whose leading pages were scored before takes their entries, and then the prefix
    cache's KV up to the last of those positions. lm-eval's multiple-choice requests share their context this way;
    vLLM recomputes it for each. Entries with at least the top-k asked serve (the top lists cut to k); the page's
    tokens are compared as the prefix cache compares them. Off where the prefix cache is."""

    def __init__(self, cache: PrefixCache, max_pairs: int = ENTRY_CACHE_PAIRS):
        self.cache, self.max_pairs = cache, max_pairs
        self.pages: OrderedDict[bytes, tuple[bytes, int, list]] = OrderedDict()  # key -> (tokens, k, entries)
        self.pairs = 0  # (token, logprob) pairs held: each entry's own and its k alternatives
        self.hit_tokens = 0

    def fill(self, req) -> None:
        """A request asking for prompt logprobs, before its first admission: the cached entries of its leading
        full pages. Entries for targets [0, e x page) make positions up to e x page - 1 asked, so the prefix
        cache may serve e - 1 pages of KV (`Req.cacheable_tokens`); the position before page e is computed."""
        fresh = req.prompt_logprobs is not None and not req.prompt_lp_asked and len(req.prompt_logprobs) == 1
        if not fresh or not self.cache.enabled:
            return
        ps, k = self.cache.page_size, req.sampling.prompt_logprobs
        full = req.prompt_len // ps
        self.cache.extend_keys(req.page_hashes, req.tokens, full)
        got: list = []
        for i in range(full):
            hit = self.pages.get(req.page_hashes[i])
            if hit is None or hit[1] < k or hit[0] != token_bytes(req.tokens[i * ps:(i + 1) * ps]):
                break
            self.pages.move_to_end(req.page_hashes[i])
            got += [e if e is None else {**e, "top": e["top"][:k]} for e in hit[2]]
        if got:
            req.prompt_logprobs, req.prompt_lp_asked = got, len(got) - 1
            self.hit_tokens += len(got)

    def store(self, req) -> None:
        """A request's complete entries, a full prompt page at a time (kept with the larger top-k)."""
        plp, ps = req.prompt_logprobs, self.cache.page_size
        if plp is None or len(plp) < req.prompt_len or not self.cache.enabled:
            return
        full = req.prompt_len // ps
        self.cache.extend_keys(req.page_hashes, req.tokens, full)
        k = req.sampling.prompt_logprobs
        for i in range(full):
            key = req.page_hashes[i]
            old = self.pages.get(key)
            if old is not None and old[1] >= k:
                self.pages.move_to_end(key)
                continue
            if old is not None:
                self.pairs -= ps * (old[1] + 1)
            self.pages[key] = (token_bytes(req.tokens[i * ps:(i + 1) * ps]), k, plp[i * ps:(i + 1) * ps])
            self.pages.move_to_end(key)
            self.pairs += ps * (k + 1)
        while self.pairs > self.max_pairs and self.pages:
            self.pairs -= ps * (self.pages.popitem(last=False)[1][1] + 1)
