"""Core limits for every kernel: the caller's through threadpoolctl, and fewer threads for small work.

The kernels spend their time in SciPy's BLAS/LAPACK (and NumPy's, for the
glue), whose thread pools threadpoolctl controls; the Cython loops of their
own (im2col, tile additions) are single-threaded.

Within the caller's limit each kernel runs ``max(1, flops // flops_per_thread)``
threads: one thread per ``FLOPS_PER_THREAD`` of work. Below that, waking a
second BLAS thread costs more than it saves, and two OpenBLAS pools (NumPy's
and SciPy's each have one) that both wake threads on few cores fight for them
(docs/results/kernels_notes.md). The count is set directly through OpenBLAS's
``openblas_set_num_threads`` of every OpenBLAS library threadpoolctl finds
(pthreads builds; other BLAS libraries keep the caller's limit), process-wide,
like threadpoolctl's limits.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import numbers
import os
from collections.abc import Iterator
from contextlib import contextmanager

from threadpoolctl import ThreadpoolController

from . import _kernels

__all__ = ["limit_cores", "available_cores", "blas_info", "threads_for", "sized_threads",
           "get_flops_per_thread", "set_flops_per_thread", "FLOPS_PER_THREAD", "thread_trials",
           "reset_thread_trials"]

#: Work (flops, 2 x multiply-adds; N d^2 for a Gram) that pays for one more BLAS thread,
#: fitted on 2-core machines by experiments/threads_report.py (docs/results/kernels_notes.md).
#: FASTLS_FLOPS_PER_THREAD overrides it (0: always the caller's limit).
FLOPS_PER_THREAD = 1e4

_controller = None
_bound = False
# Every OpenBLAS build threadpoolctl knows names its thread functions with one of these affixes.
_OPENBLAS_AFFIXES = tuple(itertools.product(("", "scipy_"), ("", "64_", "_64")))


def _get_controller():
    """One controller per process, created on first use (as scikit-learn does).

    Creating it inspects every loaded shared library, which is too slow to
    repeat per call and pointless at import time.
    """
    global _controller
    if _controller is None:
        _controller = ThreadpoolController()
    return _controller


def available_cores() -> int:
    """Number of cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@contextmanager
def limit_cores(n_cores: int) -> Iterator[None]:
    """Run the enclosed kernels on at most ``n_cores`` BLAS threads.

    Parameters
    ----------
    n_cores : int >= 1
        Threads allowed to every BLAS library loaded in the process (SciPy's,
        through which the kernels run, and NumPy's).

    Notes
    -----
    The limit is process-wide while the block runs, as with threadpoolctl;
    previous limits are restored on exit, also on error. Blocks that overlap
    in time from several Python threads are not supported: each restores the
    limit it found, so one that exits last can restore another's, and
    interleaved blocks can leave the process at 1 thread for good.
    fedlayer runs its clients' blocks one at a time.
    """
    if isinstance(n_cores, bool) or not isinstance(n_cores, numbers.Integral) or n_cores < 1:
        raise ValueError(f"n_cores must be an integer >= 1, got {n_cores!r}")
    with _get_controller().limit(limits=int(n_cores), user_api="blas"):
        yield


def blas_info() -> list[dict]:
    """threadpoolctl's description of the BLAS libraries and their threads."""
    return [info for info in _get_controller().info() if info.get("user_api") == "blas"]


def _thread_functions(library):
    """Addresses of an OpenBLAS library's get/set_num_threads, or None when it is not a pthreads OpenBLAS."""
    if library.internal_api != "openblas" or getattr(library, "threading_layer", None) != "pthreads":
        return None
    dynlib = ctypes.CDLL(library.filepath)
    for prefix, suffix in _OPENBLAS_AFFIXES:
        getter = getattr(dynlib, f"{prefix}openblas_get_num_threads{suffix}", None)
        setter = getattr(dynlib, f"{prefix}openblas_set_num_threads{suffix}", None)
        if getter is not None and setter is not None:
            return ctypes.cast(getter, ctypes.c_void_p).value, ctypes.cast(setter, ctypes.c_void_p).value
    return None


def _bind():
    global _bound
    if not _bound:
        found = (_thread_functions(lib) for lib in _get_controller().lib_controllers if lib.user_api == "blas")
        _kernels.bind_blas_threads([pair for pair in found if pair is not None])
        _bound = True


def _checked_flops(value, source):
    try:
        flops = float("nan") if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        flops = float("nan")
    if not 0 <= flops < float("inf"):
        raise ValueError(f"{source} must be a finite number >= 0 (flops of work per BLAS thread; 0 turns the "
                         f"size rule off), got {value!r}")
    return flops


# An empty variable (FASTLS_FLOPS_PER_THREAD=) counts as unset, as shells treat it.
_flops_per_thread = _checked_flops(os.environ.get("FASTLS_FLOPS_PER_THREAD") or FLOPS_PER_THREAD,
                                   "FASTLS_FLOPS_PER_THREAD")


def get_flops_per_thread() -> float:
    """Work (flops) that pays for one more BLAS thread; 0 means the caller's limit always applies."""
    return _flops_per_thread


def set_flops_per_thread(flops: float) -> float:
    """Set the work per thread of the size rule (0 turns the rule off); returns the previous value.

    Parameters
    ----------
    flops : float >= 0
        A kernel of W flops runs ``max(1, W // flops)`` threads within the
        caller's limit. The default, :data:`FLOPS_PER_THREAD`, was measured
        on a 2-core machine; ``experiments/threads_report.py`` measures it
        on another.
    """
    global _flops_per_thread
    flops = _checked_flops(flops, "flops")
    previous, _flops_per_thread = _flops_per_thread, flops
    _kernels.set_rule(flops, _bind)
    return previous


def threads_for(flops: float) -> int:
    """BLAS threads the size rule gives a kernel of ``flops`` work, within the current limit.

    Parameters
    ----------
    flops : float
        The kernel's work, counted as 2 x multiply-adds (N d^2 for a Gram of N x d).

    Returns
    -------
    int >= 1
    """
    _bind()
    limit = _kernels.blas_threads() or 1
    if _flops_per_thread == 0:
        return limit
    return int(max(1, min(limit, flops // _flops_per_thread)))


class ThreadTrials:
    """Thread counts learned by timing: the first calls of a kind run one thread, then the rule's count.

    For kernels whose best thread count the size rule cannot predict (it
    flips between machines and between days of one VM), each kind of call,
    a ``key`` such as (dtype, width, rows scale), runs ``trials + 1`` calls
    on one thread, then ``trials + 1`` on the rule's count. The first call of
    each block is not timed (it wakes or parks the second thread), and
    blocks rather than alternation keep one setting's idle workers from
    slowing the other's calls. From then on the kind runs the rule's count
    if its fastest call took at most ``margin`` of one thread's time per
    flop, else one thread: a near tie keeps the count that cannot oversubscribe.
    A process learns each kind once; :func:`thread_trials` shows what it
    chose, :func:`reset_thread_trials` forgets it.
    """

    def __init__(self, trials=3, margin=0.95):
        self.trials = int(trials)
        self.margin = float(margin)
        self._seconds = {}  # key -> (calls so far, seconds per flop with one thread, with the rule's threads)
        self._choice = {}   # key -> the threads chosen

    def plan(self, key, flops):
        """(flops to give sized_threads, trial to record or None) for a call of ``flops`` work."""
        if _flops_per_thread == 0:  # the rule is off: the caller's limit, untimed
            return flops, None
        threads = threads_for(flops)
        if threads == 1:
            return 0.0, None
        key = (*key, threads)
        choice = self._choice.get(key)
        if choice is not None:
            return (flops if choice > 1 else 0.0), None
        calls = self._seconds.setdefault(key, [0, [], []])[0]
        more = calls > self.trials  # calls 0..trials on one thread, the next trials + 1 on the rule's
        return (flops if more else 0.0), (key, more, calls % (self.trials + 1) != 0)

    def record(self, trial, seconds, flops):
        """Log the call ``trial`` (from :meth:`plan`) of ``flops`` work that took ``seconds``."""
        key, more, timed = trial
        state = self._seconds.get(key)
        if state is None:  # decided meanwhile (another thread's call)
            return
        state[0] += 1
        if timed:
            state[1 + more].append(seconds / flops)
        # Calls planned at once from several threads may all take untimed slots: decide on both timings only.
        if state[0] >= 2 * (self.trials + 1) and state[1] and state[2]:
            one, rule = min(state[1]), min(state[2])
            self._choice[key] = key[-1] if rule <= self.margin * one else 1
            self._seconds.pop(key, None)
        elif state[0] >= 4 * (self.trials + 1):
            self._seconds.pop(key, None)  # a block passed untimed: the kind's trials start again

    def choices(self):
        return dict(self._choice)

    def reset(self):
        self._seconds.clear()
        self._choice.clear()


#: The timed choice of narrow Grams (see fastls._products.GRAM_MIN_THREADED_D).
narrow_gram_trials = ThreadTrials()


def thread_trials() -> dict[tuple, int]:
    """What timing chose so far: {(dtype char, d, log2 rows, threads tried): threads chosen}, narrow Grams."""
    return narrow_gram_trials.choices()


def reset_thread_trials() -> None:
    """Forget the thread counts learned by timing (e.g. after moving to other cores)."""
    narrow_gram_trials.reset()


def run_spans(fn, spans):
    """fn(span) for every span, one thread each (the calling thread alone for a single span).

    For memory-bound loops that release the GIL, split by the caller into as
    many spans as :func:`threads_for` allows.
    """
    if len(spans) == 1:
        fn(spans[0])
        return
    with concurrent.futures.ThreadPoolExecutor(len(spans)) as pool:
        list(pool.map(fn, spans))


# The context manager is compiled: entering it costs well under a microsecond.
sized_threads = _kernels.sized_threads
_kernels.set_rule(_flops_per_thread, _bind)
