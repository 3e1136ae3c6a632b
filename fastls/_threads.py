"""Core limits for every kernel, through threadpoolctl.

The kernels spend their time in SciPy's BLAS/LAPACK (and NumPy's, for the
glue), whose thread pools threadpoolctl controls; the Cython loops of their
own (im2col, tile additions) are single-threaded.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController

__all__ = ["limit_cores", "available_cores", "blas_info"]

_controller = None


def _get_controller():
    """One controller per process, created on first use (as scikit-learn does).

    Creating it inspects every loaded shared library, which is too slow to
    repeat per call and pointless at import time.
    """
    global _controller
    if _controller is None:
        _controller = ThreadpoolController()
    return _controller


def available_cores():
    """Number of cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@contextmanager
def limit_cores(n_cores):
    """Run the enclosed kernels on at most ``n_cores`` BLAS threads.

    Parameters
    ----------
    n_cores : int >= 1
        Threads allowed to every BLAS library loaded in the process (SciPy's,
        through which the kernels run, and NumPy's).

    Notes
    -----
    The limit is process-wide while the block runs, as with threadpoolctl;
    previous limits are restored on exit, also on error.
    """
    if isinstance(n_cores, bool) or not isinstance(n_cores, int) or n_cores < 1:
        raise ValueError(f"n_cores must be an integer >= 1, got {n_cores!r}")
    with _get_controller().limit(limits=n_cores, user_api="blas"):
        yield


def blas_info():
    """threadpoolctl's description of the BLAS libraries and their threads."""
    return [info for info in _get_controller().info() if info.get("user_api") == "blas"]
