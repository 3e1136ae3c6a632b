"""Analytic federated learning (FedACnnL, pFedACnnL) composed from fastls kernels.

The entry point for scripts is :func:`run` with a :class:`RunConfig`::

    from fedlayer import RunConfig, run
    results = run(RunConfig(algorithm="fedacnnl", dataset="synthetic", model="dnn"))

The modules hold the rest: :mod:`fedlayer.data` (datasets and partitions),
:mod:`fedlayer.models` (layers and least-squares models),
:mod:`fedlayer.algorithms` (every algorithm by name), :mod:`fedlayer.timing`
(the clock), :mod:`fedlayer.mpi` (clients on other ranks).
"""

from .run import RunConfig, run

__all__ = ["RunConfig", "run"]
__version__ = "0.1.0"
