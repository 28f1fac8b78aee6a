"""PrefixCache: SHA-256 chain keys, verified hits, LRU eviction of unreferenced pages."""

from __future__ import annotations

import dsaserve.engine.prefix_cache as pc
from dsaserve.engine.page_allocator import PageAllocator
from dsaserve.engine.prefix_cache import PrefixCache

PS = 4


def _filled(cache: PrefixCache, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    """Allocate pages for `tokens`, register the full ones, keep the references (a running request)."""
    pages = cache.allocate(-(-len(tokens) // PS))
    keys: list[bytes] = []
    cache.insert(pages, tokens, keys, 0, len(tokens) // PS, 0)
    return pages, keys


def test_hit_returns_the_same_pages_and_counts_a_reference():
    cache = PrefixCache(PageAllocator(8), PS)
    toks = list(range(10))
    pages, _ = _filled(cache, toks)
    hits = cache.match(toks + [99], [], 2)
    assert hits == pages[:2]
    assert [cache.alloc.refcount(p) for p in hits] == [2, 2]


def test_key_chain_covers_the_prefix_so_equal_pages_after_different_prefixes_do_not_match():
    cache = PrefixCache(PageAllocator(8), PS)
    _filled(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([9, 2, 3, 4, 5, 6, 7, 8, 0], [], 2) == []
    assert len(cache.match([1, 2, 3, 4, 9, 9, 9, 9, 0], [], 2)) == 1


def test_keys_are_sha256_of_parent_key_and_int64_tokens():
    import hashlib
    import struct

    keys: list[bytes] = []
    PrefixCache(PageAllocator(1), PS).extend_keys(keys, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    k0 = hashlib.sha256(pc.ROOT_KEY + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert keys == [k0, hashlib.sha256(k0 + struct.pack("<4q", 5, 6, 7, 8)).digest()]


def test_engineered_key_collisions_never_share_foreign_pages(monkeypatch):
    # every page gets the same key: only the token / chain verification stands between requests
    monkeypatch.setattr(pc, "page_key", lambda parent, toks: b"\x00" * 32)
    cache = PrefixCache(PageAllocator(8), PS)
    _filled(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert cache.match([5, 6, 7, 8, 1, 2, 3, 4, 0], [], 2) == []  # page contents swapped
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8, 0], [], 2) == []  # same 2nd page, other prefix
    assert len(cache.match([1, 2, 3, 4, 5, 6, 7, 8, 0], [], 2)) == 1  # key slot holds page 1 only
    assert cache.hit_tokens == PS


def test_released_cached_pages_are_evicted_lru_tail_first_only_when_the_pool_runs_short():
    cache = PrefixCache(PageAllocator(4), PS)
    a, _ = _filled(cache, list(range(8)))  # 2 cached pages
    cache.release(a)
    assert cache.num_evictable == 2 and cache.alloc.num_free == 2
    cache.allocate(3)  # one eviction: the sequence's tail page goes first
    assert cache.evicted_pages == 1
    assert len(cache.match(list(range(8)) + [0], [], 2)) == 1  # the first page survived


def test_a_hit_on_an_unreferenced_page_takes_it_off_the_eviction_list():
    cache = PrefixCache(PageAllocator(2), PS)
    a, _ = _filled(cache, list(range(4)))
    cache.release(a)
    assert cache.num_evictable == 1
    hit = cache.match(list(range(4)) + [0], [], 1)
    assert hit == a[:1] and cache.num_evictable == 0 and cache.num_available() == 1


def test_concurrent_twin_pages_stay_private_and_the_chain_continues_through_the_cached_twin():
    cache = PrefixCache(PageAllocator(8), PS)
    toks = list(range(12))
    a, _ = _filled(cache, toks[:8])
    b = cache.allocate(3)
    uid = cache.insert(b, toks, [], 0, 3, 0)  # b's first two pages duplicate a's; its third is new
    assert uid > 0
    assert cache.match(toks + [0], [], 3) == [a[0], a[1], b[2]]
    cache.release(b)
    assert cache.alloc.num_free == 8 - 2 - 3 + 2  # b's twins went back to the free list


def test_disabled_cache_never_matches_and_frees_released_pages():
    cache = PrefixCache(PageAllocator(4), PS, enabled=False)
    pages, _ = _filled(cache, list(range(8)))
    assert cache.match(list(range(8)) + [0], [], 2) == []
    cache.release(pages)
    assert cache.alloc.num_free == 4 and cache.num_evictable == 0
