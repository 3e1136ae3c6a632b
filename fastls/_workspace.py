"""Large arrays that reuse the memory of their predecessor.

A client of the full-width DCNN builds a 2.7 GB float64 Gram per layer, and the
overlap statistics hold 1.3 GB of per-group products; the next client asks
for the same shapes. Fresh memory from the operating system is zeroed page by
page on first touch, at a few GB/s (docs/results/kernels_notes.md). Handing
back the previous array once nobody holds it turns that into a memset (or
nothing).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Hashable

import numpy as np
from numpy.typing import DTypeLike

from ._threads import run_spans, threads_for

__all__ = ["recycled_array", "release", "recycled_nbytes", "DEFAULT_SCRATCH_BYTES"]

#: Default bound on the working memory (patches, tiles, row slices) of one kernel call.
DEFAULT_SCRATCH_BYTES = 64 * 2**20

_held = {}
_lock = threading.Lock()
# References to an array popped from _held: the local name and getrefcount's argument.
_UNSHARED_REFCOUNT = 2
# Arrays at least this large are zeroed by as many threads as the caller's core
# limit allows: the memset is memory-bound, and one thread leaves bandwidth
# unused (docs/results/kernels_notes.md).
PARALLEL_ZERO_BYTES = 64 * 2**20


def recycled_array(key: Hashable, shape: int | tuple[int, ...], dtype: DTypeLike = np.float64, *,
                   zero: bool = True) -> np.ndarray:
    """A C-contiguous array, the memory of the last one handed out under ``key`` when it is free again.

    The previous array is reused only when nothing references it any more
    (neither it nor any view of it: a view holds its base), so a caller that
    keeps its array keeps it intact; otherwise a new one is allocated and the
    old one is forgotten. One array is held per key between calls.

    Parameters
    ----------
    key : hashable
        Who asks (e.g. ``"fastls.overlap"``); each key holds one array.
    shape : tuple of int
    dtype : float32 or float64 (any NumPy dtype works)
    zero : bool, default=True
        Zero the array; without it the contents are whatever was there.

    Returns
    -------
    ndarray of ``shape`` and ``dtype``
    """
    shape = tuple(int(n) for n in shape)
    dtype = np.dtype(dtype)
    with _lock:
        previous = _held.pop(key, None)
        if (previous is not None and previous.shape == shape and previous.dtype == dtype
                and sys.getrefcount(previous) == _UNSHARED_REFCOUNT):
            out = previous
            if zero:
                _zero(out)
        else:
            # Forget the old array before allocating: if it was free, its memory goes first.
            del previous
            out = np.zeros(shape, dtype) if zero else np.empty(shape, dtype)
        _held[key] = out
        return out


def release(key: Hashable | None = None) -> None:
    """Forget the array held under ``key`` (every key when None); its memory goes when nobody holds it."""
    with _lock:
        if key is None:
            _held.clear()
        else:
            _held.pop(key, None)


def recycled_nbytes() -> int:
    """Bytes of the arrays held for reuse, whether or not a caller still uses them."""
    with _lock:
        return sum(a.nbytes for a in _held.values())


def _zero(out):
    """out[...] = 0, split over the threads the caller's core limit allows when out is large."""
    # Its bytes stand for the work: at this size the rule gives the caller's whole limit.
    threads = threads_for(out.nbytes) if out.nbytes >= PARALLEL_ZERO_BYTES else 1
    if threads == 1:
        out.fill(0)
        return
    flat = out.reshape(-1)  # a view: recycled arrays are C-contiguous
    bounds = np.linspace(0, flat.size, threads + 1).astype(np.intp)
    # copyto releases the GIL for the copy.
    run_spans(lambda span: np.copyto(flat[span[0]:span[1]], 0), list(zip(bounds[:-1], bounds[1:])))
