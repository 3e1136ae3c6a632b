"""Random draws for zeroth-order estimates: a counter-based N(0, 1) stream, filled row by row."""

from __future__ import annotations

import numpy as np

from . import _random

__all__ = ["normal_rows"]

_MAX_KEY = (1 << 64) - 1
#: Draws a stream holds: a draw's second tries are words 64 i + k of a second stream.
STREAM_DRAWS = 1 << 58


def normal_rows(out: np.ndarray, key: int, start: int = 0) -> np.ndarray:
    """Fill ``out`` with draws start, start + 1, ... of the N(0, 1) stream ``key``; return each row's sum of squares.

    Draw ``i`` of a stream is a function of ``(key, i)`` alone (SplitMix64
    words at an increment of the stream's own, through a 256-layer ziggurat;
    2**58 draws a stream), so a stream can be filled in pieces,
    in any order, on any thread, with the same numbers. The sums of squares
    are added in order along each row while the row is drawn, so they do not
    depend on how the rows are laid out or stacked.

    Parameters
    ----------
    out : ndarray of shape (rows, d), float64, C-contiguous
        Overwritten, row by row: row r holds draws ``start + r d`` to ``start + (r + 1) d - 1``.
    key : int in [0, 2**64)
        The stream.
    start : int in [0, 2**58)
        The first draw's index.

    Returns
    -------
    sumsq : ndarray of shape (rows,), float64
    """
    if not isinstance(out, np.ndarray) or out.ndim != 2 or out.dtype != np.float64 or not out.flags.c_contiguous:
        got = f"{out.dtype} array of shape {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise ValueError(f"out must be a C-contiguous float64 array of shape (rows, d), got {got}")
    if not out.flags.writeable:
        raise ValueError("out must be writeable")
    for name, value in (("key", key), ("start", start)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= int(value) <= _MAX_KEY:
            raise ValueError(f"{name} must be an integer in [0, 2**64), got {value!r}")
    if int(start) + out.size > STREAM_DRAWS:
        raise ValueError(f"draws {start} to {int(start) + out.size - 1} run past the stream's 2**58 draws")
    sumsq = np.empty(out.shape[0])
    _random.normal_rows(out, sumsq, int(key), int(start))
    return sumsq
