"""The protocol's public names under their first module: FedACnnL, its variants and pFedACnnL.

The server is :mod:`fedlayer.server` (stages over one state, a solver per
layer, the secure sums); its options are :class:`fedlayer.options.ServerOptions`.
This module keeps the names scripts and experiments import from here.
"""

from .options import UPLOAD_MODES
from .server import (EXCLUDED, SECURE_ATTEMPTS, VARIANTS, AllClientsDropped, Variant, adaptive_batch_sizes,
                     merge_small_groups, run_protocol, survivors_solution)

__all__ = ["EXCLUDED", "SECURE_ATTEMPTS", "UPLOAD_MODES", "VARIANTS", "AllClientsDropped", "Variant",
           "adaptive_batch_sizes", "merge_small_groups", "run_protocol", "survivors_solution"]
