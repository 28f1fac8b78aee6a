"""PrefixCache: full KV pages shared between requests with the same token prefix (request path stage 3).

Owns: the map from a page's content key to the physical page that holds its KV, the LRU of cached pages
nobody references, eviction when the allocator runs short, and the hit / eviction counters. A hit
shares the page (refcount + 1) and skips its prefill; since the main KV and the indexer K of a token live
at the same slot of KVPool, sharing the page shares both (note 001, "前缀缓存命中如何改写账本").

Key of page i of a sequence = SHA-256(key of page i-1 || its 64 token ids as int64 little-endian), with a
fixed root: a chain, so a page's key covers the whole prefix before it (the vLLM v1 / SGLang scheme,
usable across processes). Fixed-width token encoding makes the byte string unambiguous. On top of the
key, every hit is *verified*: the cached page must hold exactly the same 64 token ids and hang off the
very page the previous hit returned (by registration id, so a reused page id cannot pass). A collision
of the key, engineered or not, therefore only costs a miss, never another request's KV.

Pages enter the cache as soon as they are full and computed (not only when a request finishes), so
identical prompts in flight, `n` > 1 samples and recomputation after preemption all reuse them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from dsaserve.engine.page_allocator import PageAllocator

ROOT_KEY = hashlib.sha256(b"dsaserve prefix cache v1").digest()


def page_key(parent_key: bytes, page_tokens: bytes) -> bytes:
    return hashlib.sha256(parent_key + page_tokens).digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return array("q", tokens).tobytes()


class _Entry:
    __slots__ = ("key", "tokens", "parent_uid", "uid")

    def __init__(self, key: bytes, tokens: bytes, parent_uid: int, uid: int):
        self.key, self.tokens, self.parent_uid, self.uid = key, tokens, parent_uid, uid


class PrefixCache:
    """Content-addressed full pages over a PageAllocator. With enabled=False it caches nothing."""

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        self.alloc, self.page_size, self.enabled = allocator, page_size, enabled
        self._by_key: dict[bytes, int] = {}
        self._entry: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached pages with refcount 0, oldest first
        self._next_uid = 1  # 0 is the root
        self.hit_tokens = 0
        self.evicted_pages = 0

    # ---- capacity --------------------------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._entry)

    def num_available(self) -> int:
        """Pages an allocation can get now: free ones plus unreferenced cached ones."""
        return self.alloc.num_free + len(self._lru)

    def allocate(self, n: int) -> list[int]:
        """n pages (refcount 1), evicting least-recently-used unreferenced cached pages if needed."""
        short = n - self.alloc.num_free
        if short > 0:
            self._evict(short)
        return self.alloc.allocate(n)

    def _evict(self, n: int) -> None:
        for _ in range(min(n, len(self._lru))):
            page, _ = self._lru.popitem(last=False)
            e = self._entry.pop(page)
            if self._by_key.get(e.key) == page:
                del self._by_key[e.key]
            self.alloc.free(page)
            self.evicted_pages += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page; unreferenced ones become evictable (if cached) or free.

        Released tail-first, so a sequence's last pages are the first evicted and its prefix, which
        other requests are likelier to share, stays longest (as vLLM v1).
        """
        for p in reversed(pages):
            if self.alloc.decref(p):
                if p in self._entry:
                    self._lru[p] = None
                else:
                    self.alloc.free(p)

    def share(self, page: int) -> None:
        """One more holder of a page that already has one (n > 1 forks)."""
        self.alloc.incref(page)

    # ---- keys ------------------------------------------------------------------------------
    def extend_keys(self, keys: list[bytes], tokens: Sequence[int], num_pages: int) -> None:
        """Append chain keys to `keys` until it covers the first `num_pages` full pages of `tokens`."""
        ps = self.page_size
        parent = keys[-1] if keys else ROOT_KEY
        for i in range(len(keys), num_pages):
            parent = page_key(parent, token_bytes(tokens[i * ps:(i + 1) * ps]))
            keys.append(parent)

    # ---- lookup and insert -----------------------------------------------------------------
    def match(self, tokens: Sequence[int], keys: list[bytes], max_pages: int) -> list[int]:
        """Longest cached, verified prefix of at most `max_pages` pages; each hit page gets a reference."""
        if not self.enabled or max_pages <= 0:
            return []
        self.extend_keys(keys, tokens, max_pages)
        ps, hits, parent_uid = self.page_size, [], 0
        for i in range(max_pages):
            page = self._by_key.get(keys[i])
            if page is None:
                break
            e = self._entry[page]
            if e.parent_uid != parent_uid or e.tokens != token_bytes(tokens[i * ps:(i + 1) * ps]):
                break  # a key collision: treat as a miss, never share foreign KV
            hits.append(page)
            parent_uid = e.uid
        for page in hits:
            if self.alloc.refcount(page) == 0:
                del self._lru[page]
            self.alloc.incref(page)
        self.hit_tokens += len(hits) * ps
        return hits

    def insert(self, pages: Sequence[int], tokens: Sequence[int], keys: list[bytes], start: int, end: int,
               parent_uid: int) -> int:
        """Register full pages start..end-1 of a sequence (its `pages`, `tokens`, chain `keys`).

        `parent_uid` is the registration id page `start` hangs off (0 for the first page; what the
        previous call returned otherwise). Returns the id the next page must hang off, -1 once the chain
        is broken (then nothing later is registered: it could never be reached by a verified lookup).
        A page whose content is already cached (computed twice concurrently) stays private and is freed
        normally; the chain continues through its cached twin, so lookups of later pages still succeed.
        """
        if not self.enabled or end <= start or parent_uid < 0:
            return parent_uid if self.enabled else -1
        self.extend_keys(keys, tokens, end)
        ps = self.page_size
        for i in range(start, end):
            page, tb = pages[i], token_bytes(tokens[i * ps:(i + 1) * ps])
            known = page if page in self._entry else self._by_key.get(keys[i])
            if known is not None:  # a hit page, or a twin computed by another request
                e = self._entry[known]
                if e.parent_uid != parent_uid or e.tokens != tb:
                    return -1  # a key collision with foreign content: stop here
                parent_uid = e.uid
                continue
            uid, self._next_uid = self._next_uid, self._next_uid + 1
            self._entry[page] = _Entry(keys[i], tb, parent_uid, uid)
            self._by_key[keys[i]] = page
            parent_uid = uid
        return parent_uid

    def uid(self, page: int) -> int:
        """Registration id of a cached page (what the next page of its sequence hangs off)."""
        return self._entry[page].uid

    # ---- checks ----------------------------------------------------------------------------
    def cached_pages(self) -> set[int]:
        return set(self._entry)

    def evictable_pages(self) -> set[int]:
        return set(self._lru)
