"""PageAllocator: which KV pages are free and how many holders each used page has (request path stage 3).

Owns: the free list and the refcount of every page of the KV pool (engine/kv_pool.py stores the bytes;
this file only decides who owns which page). Pure Python, no torch. A page is in exactly one state:
  free       refcount 0, on the free list
  used       refcount > 0 (held by running requests; shared pages have refcount > 1)
  cached     refcount 0 but kept by the prefix cache (engine/prefix_cache.py), reclaimable by eviction
The prefix cache decides between "free" and "cached" when a refcount drops to zero.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """More pages were asked for than are free; the scheduler checks first, so this is a bug if raised."""


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages: the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # a stack: pop() hands out low page ids first, and recently freed (cache-warm) pages are reused first
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._ref: list[int] = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def allocate(self, n: int) -> list[int]:
        """n free pages, each with refcount 1."""
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        if n <= 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        ref = self._ref
        for p in pages:
            ref[p] = 1
        return pages

    def incref(self, page: int) -> None:
        self._ref[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one holder; True when the page has none left (the caller frees or caches it)."""
        r = self._ref[page] - 1
        if r < 0:
            raise RuntimeError(f"page {page}: refcount below zero (double free)")
        self._ref[page] = r
        return r == 0

    def free(self, page: int) -> None:
        """Return an unreferenced page to the free list."""
        if self._ref[page] != 0:
            raise RuntimeError(f"page {page}: freed while still referenced ({self._ref[page]} holders)")
        self._free.append(page)

    def num_used(self) -> int:
        return sum(1 for r in self._ref if r > 0)

    def free_set(self) -> set[int]:
        return set(self._free)
