"""The server of FedACnnL / pFedACnnL: stages over one state.

* :mod:`~fedlayer.server.state`: :class:`ServerState`, exactly what a
  checkpoint holds (groups, batch sizes, first-round durations, weights per
  group, rounds, layers done);
* :mod:`~fedlayer.server.stages`: :func:`initialize`, :func:`train_layer`,
  :func:`personalize`, which read and update it, and :func:`run_protocol`,
  which runs them;
* :mod:`~fedlayer.server.solvers`: how a layer is solved (fixed gamma, GCV
  per group, GCV pooled over the groups), one object chosen per layer;
* :mod:`~fedlayer.server.secure_sums`: the server's half of the secure sums;
* :mod:`~fedlayer.server.grouping`: K-means groups, small groups merged.

The options the server reads are :class:`fedlayer.options.ServerOptions`.
"""

from .grouping import cluster, merge_small_groups
from .reference import survivors_solution
from .secure_sums import EXCLUDED, SECURE_ATTEMPTS, SecureSums
from .solvers import FixedGamma, GroupGCV, LayerSolver, PooledGCV, SummedStatistics, choose_solver
from .stages import (VARIANTS, AllClientsDropped, ModelLayers, ProtocolRun, Variant, adaptive_batch_sizes, initialize,
                     personalize, run_protocol, targets_cross, train_layer)
from .state import ServerState

__all__ = ["EXCLUDED", "SECURE_ATTEMPTS", "VARIANTS", "AllClientsDropped", "FixedGamma", "GroupGCV", "LayerSolver",
           "ModelLayers", "PooledGCV", "ProtocolRun", "SecureSums", "ServerState", "SummedStatistics", "Variant",
           "adaptive_batch_sizes", "choose_solver", "cluster", "initialize", "merge_small_groups", "personalize",
           "run_protocol", "survivors_solution", "targets_cross", "train_layer"]
