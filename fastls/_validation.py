"""Argument checks shared by the kernels: dtypes, shapes, layouts, finiteness and overflow.

Each check raises with the argument's name, what was expected and what was
received, before any output is written.
"""

from __future__ import annotations

import numbers

import numpy as np

from . import _kernels

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# BLAS and LAPACK take their sizes as 32-bit ints: a larger dimension would wrap around.
_BLAS_INT_MAX = 2**31 - 1


def _check_array(name, A, ndim):
    if not isinstance(A, np.ndarray):
        raise TypeError(f"{name} must be a NumPy array, got {type(A).__name__}")
    if A.dtype not in _FLOATS:
        raise TypeError(f"{name} must have dtype float32 or float64, got {A.dtype}")
    if A.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-dimensional, got shape {A.shape}")
    if A.ndim and max(A.shape) > _BLAS_INT_MAX:
        raise ValueError(f"{name} has a dimension above 2^31 - 1 (shape {A.shape}), more than BLAS's 32-bit sizes "
                         f"can express; pass it in blocks of rows")


def _check_output(name, A, ndim):
    _check_array(name, A, ndim)
    if not A.flags.writeable:
        raise ValueError(f"{name} is read-only; it is updated in place and must be writable")
    if not (A.flags.c_contiguous or A.flags.f_contiguous):
        raise ValueError(
            f"{name} must be C- or Fortran-contiguous (it is updated in place), "
            f"got strides {A.strides} for shape {A.shape}"
        )


def _check_disjoint(out_name, out, **inputs):
    """Refuse an output that shares memory with an input it is computed from (it would read half-written values)."""
    for name, A in inputs.items():
        if isinstance(A, np.ndarray) and np.may_share_memory(out, A):
            try:
                overlap = np.shares_memory(out, A, max_work=100_000)
            except np.exceptions.TooHardError:  # pragma: no cover - views too intricate to tell apart
                overlap = True
            if overlap:
                raise ValueError(f"{out_name} shares memory with {name}: {out_name} is written while {name} is "
                                 f"read, which would give a wrong result; pass a copy of {name}")


def _check_accumulated(name, A, what):
    """After an in-place float32 accumulation: raise when it overflowed (``A`` holds Inf)."""
    if A.dtype == np.float32 and not np.isfinite(A).all():
        raise ValueError(f"{name} overflowed float32 while adding {what} (its previous values plus the update "
                         f"exceed {np.finfo(np.float32).max:.3g}); accumulate into a float64 {name}")


def _as_input(A):
    """A itself when BLAS can read it, else a C-contiguous copy."""
    if A.flags.c_contiguous or A.flags.f_contiguous:
        return A
    return np.ascontiguousarray(A)


def _layout(A):
    """(rowmajor, leading dimension) of a contiguous matrix, as BLAS needs."""
    if A.flags.c_contiguous:
        return True, max(1, A.shape[1])
    return False, max(1, A.shape[0])


def _check_finite(name, A):
    if A.size == 0:
        return
    if A.flags.c_contiguous or A.flags.f_contiguous:
        # The transpose of an F-ordered array is C-ordered: scan memory in order.
        flat = A if A.flags.c_contiguous else A.T
        finite = _kernels.all_finite(flat.reshape(flat.shape[0], -1))
    else:
        finite = bool(np.isfinite(A).all())  # a strided view (e.g. every other column)
    if not finite:
        raise ValueError(f"{name} contains NaN or Inf; expected finite values")


def _check_finite_upper(G):
    """The upper triangle of a Gram matrix (the part the solves read) is finite."""
    if G.shape[0] and not _kernels.upper_finite(G):
        raise ValueError("G contains NaN or Inf in its upper triangle; expected finite values")


def _check_pair_dtypes(out_name, out, in_name, inp):
    """Same dtype, or float32 input into a float64 output; returns mixed flag."""
    if out.dtype == inp.dtype:
        return False
    if out.dtype == np.float64 and inp.dtype == np.float32:
        return True
    raise TypeError(
        f"{in_name} is {inp.dtype} but {out_name} is {out.dtype}: accumulating "
        f"float64 data into float32 would lose precision; use a float64 {out_name}"
    )


def _check_positive(name, value, meaning):
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0 ({meaning}), got {value!r}")
    return float(value)


# Counts and sizes go to C as ssize_t.
_COUNT_MAX = 2**63 - 1


def _check_count(name, value, minimum=1):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not minimum <= value <= _COUNT_MAX:
        limit = " and below 2^63" if isinstance(value, numbers.Integral) and value > _COUNT_MAX else ""
        raise ValueError(f"{name} must be an integer >= {minimum}{limit}, got {value!r}")
    return int(value)


def _squares_fit(A, rows):
    """max a^2 * rows is finite in A's dtype (so A is finite): one pass over a contiguous A, no temporary.

    Then no sum of ``rows`` products of two such arrays' entries overflows
    (Cauchy-Schwarz).
    """
    flat = A if A.flags.c_contiguous else A.T
    return bool(_kernels.squares_finite(flat.reshape(flat.shape[0], -1), float(rows)))


def _overflow_error(name, A, what):
    verb = "hold" if " and " in name else "holds"
    return ValueError(f"{name} {verb} values whose products overflow {A.dtype} in {what} (largest |x| "
                      f"{float(np.abs(A).max()):.3g}); expected finite values that {A.dtype} can multiply and sum")
