"""fastls.recycled_array: memory handed back only when nobody holds it."""

import numpy as np
import pytest

import fastls
from fastls import _workspace


@pytest.fixture(autouse=True)
def _forget():
    yield
    _workspace.release()


def test_zeroed_and_reused_once_released(rng):
    a = fastls.recycled_array("test", (40, 30))
    assert a.shape == (40, 30) and a.dtype == np.float64 and not a.any()
    a[...] = rng.standard_normal(a.shape)
    address = a.ctypes.data
    del a
    b = fastls.recycled_array("test", (40, 30))
    assert b.ctypes.data == address
    assert not b.any()


def test_an_array_still_held_is_never_handed_out_again(rng):
    a = fastls.recycled_array("test", (20, 20))
    a[...] = rng.standard_normal(a.shape)
    kept = a.copy()
    b = fastls.recycled_array("test", (20, 20))
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, kept)


def test_a_view_keeps_its_base_out_of_reach(rng):
    a = fastls.recycled_array("test", (20, 20))
    a[...] = rng.standard_normal(a.shape)
    upper = a[:5].T  # a view of a view: holds a's memory through its base
    kept = upper.copy()
    del a
    b = fastls.recycled_array("test", (20, 20))
    assert not np.shares_memory(b, upper)
    np.testing.assert_array_equal(upper, kept)


@pytest.mark.parametrize("shape,dtype", [((20, 21), np.float64), ((20, 20), np.float32)])
def test_another_shape_or_dtype_gets_a_new_array(rng, shape, dtype):
    a = fastls.recycled_array("test", (20, 20))
    a[...] = rng.standard_normal(a.shape)
    del a
    b = fastls.recycled_array("test", shape, dtype)
    assert b.shape == shape and b.dtype == dtype and not b.any()
    # The new array is the one held now: released, it comes back.
    address = b.ctypes.data
    del b
    assert fastls.recycled_array("test", shape, dtype).ctypes.data == address


def test_keys_do_not_share():
    a = fastls.recycled_array("one", (8, 8))
    address = a.ctypes.data
    del a
    b = fastls.recycled_array("two", (8, 8))
    c = fastls.recycled_array("one", (8, 8))
    assert c.ctypes.data == address and not np.shares_memory(b, c)


def test_without_zeroing_the_contents_are_kept(rng):
    a = fastls.recycled_array("test", (6, 6), zero=False)
    a[...] = 7.0
    del a
    np.testing.assert_array_equal(fastls.recycled_array("test", (6, 6), zero=False), 7.0)


@pytest.mark.parametrize("cores", [1, 2])
def test_a_large_reused_array_is_zeroed_whole_within_the_core_limit(rng, monkeypatch, cores):
    """Above PARALLEL_ZERO_BYTES the zeroing is split over threads: every element, odd sizes too."""
    monkeypatch.setattr(_workspace, "PARALLEL_ZERO_BYTES", 1024)
    a = fastls.recycled_array("test", (97, 53))
    a[...] = rng.standard_normal(a.shape)
    a[-1, -1] = np.nan
    address = a.ctypes.data
    del a
    with fastls.limit_cores(cores):
        b = fastls.recycled_array("test", (97, 53))
    assert b.ctypes.data == address
    assert not b.any() and not np.isnan(b).any()


def test_released_arrays_are_neither_counted_nor_handed_back(rng):
    fastls.release_recycled()
    a = fastls.recycled_array("one", (10, 10))
    b = fastls.recycled_array("two", (5,), np.float32)
    assert fastls.recycled_nbytes() == a.nbytes + b.nbytes == 820
    a[...] = rng.standard_normal(a.shape)
    address = a.ctypes.data
    fastls.release_recycled("two")
    assert fastls.recycled_nbytes() == a.nbytes
    fastls.release_recycled()
    assert fastls.recycled_nbytes() == 0
    c = fastls.recycled_array("one", (10, 10))
    assert not np.shares_memory(a, c) and c.ctypes.data != address and not c.any()


def test_zeroing_stays_within_the_core_limit(monkeypatch):
    monkeypatch.setattr(_workspace, "PARALLEL_ZERO_BYTES", 1024)
    spans = []
    real = _workspace.run_spans
    monkeypatch.setattr(_workspace, "run_spans", lambda fn, parts: (spans.append(len(parts)), real(fn, parts))[1])
    fastls.recycled_array("test", (97, 53))
    with fastls.limit_cores(1):
        fastls.recycled_array("test", (97, 53))
    assert spans == []  # one core: zeroed in place, never split over threads
