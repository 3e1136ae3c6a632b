"""How the kernels choose BLAS threads, methods and working memory.

The kernels apply these choices themselves; a caller needs this module only
to inspect a choice (which convolution method 'auto' takes, how many threads
a kernel of given work gets), to re-measure the size rule on another machine
(``experiments/threads_report.py``), or to size its own scratch like the kernels'.

Threads: within the caller's limit (:func:`fastls.limit_cores`) a kernel of W
flops runs ``max(1, W // get_flops_per_thread())`` BLAS threads
(:func:`threads_for`); Grams narrower than 96 columns time one thread against
the rule's count on their first calls and keep the faster
(:func:`thread_trials`). ``FASTLS_FLOPS_PER_THREAD`` in the environment sets
the initial work per thread.
"""

from ._conv import WINOGRAD_MIN_CHANNELS, conv2d_method
from ._overlap import conv_stats_cost, conv_stats_method
from ._threads import (FLOPS_PER_THREAD, get_flops_per_thread, reset_thread_trials, set_flops_per_thread,
                       sized_threads, thread_trials, threads_for)
from ._workspace import DEFAULT_SCRATCH_BYTES

__all__ = [
    "FLOPS_PER_THREAD",
    "get_flops_per_thread",
    "set_flops_per_thread",
    "threads_for",
    "sized_threads",
    "thread_trials",
    "reset_thread_trials",
    "conv2d_method",
    "WINOGRAD_MIN_CHANNELS",
    "conv_stats_cost",
    "conv_stats_method",
    "DEFAULT_SCRATCH_BYTES",
]
