"""PageAllocator: refcounts and the free list."""

from __future__ import annotations

import pytest

from dsaserve.engine.page_allocator import OutOfPages, PageAllocator


def test_allocate_hands_out_distinct_pages_with_refcount_one():
    a = PageAllocator(8)
    pages = a.allocate(5)
    assert len(set(pages)) == 5 and a.num_free == 3
    assert all(a.refcount(p) == 1 for p in pages)


def test_asking_for_more_than_free_raises_and_changes_nothing():
    a = PageAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfPages):
        a.allocate(2)
    assert a.num_free == 1


def test_shared_page_is_reusable_only_after_its_last_holder_lets_go():
    a = PageAllocator(2)
    (p,) = a.allocate(1)
    a.incref(p)
    assert a.decref(p) is False
    assert a.decref(p) is True
    a.free(p)
    assert a.num_free == 2


def test_double_free_and_freeing_a_held_page_are_errors():
    a = PageAllocator(2)
    (p,) = a.allocate(1)
    with pytest.raises(RuntimeError, match="still referenced"):
        a.free(p)
    a.decref(p)
    with pytest.raises(RuntimeError, match="below zero"):
        a.decref(p)


def test_zero_pages_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
