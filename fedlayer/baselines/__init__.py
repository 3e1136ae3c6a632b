"""Gradient and zeroth-order baselines of the paper's section 5.1, in NumPy only.

The analytic methods (FedACnnL, pFedACnnL) are compared against

* **FedAvg** (McMahan et al. 2017): ``E`` local epochs of minibatch SGD,
  sample-weighted averaging of the returned parameters;
* **FedZO** (Fang et al. 2022): ``H`` local iterations of zeroth-order SGD
  with the two-point random-direction estimator (:func:`zo_sphere_gradient`);
* **BAFFLE** (Feng et al. 2025): forward-difference Stein estimator with
  Gaussian perturbations (:func:`stein_gradient`), coordinate clipping,
  one FedAvg-style local epoch per round;
* **pFedMe** (Dinh et al. 2020): Moreau-envelope personalization;
* **pFedZO** (Chen et al. 2024): pFedMe with the inner gradient replaced by
  the two-point zeroth-order estimate.

Models (:class:`BaselineModel`) are the paper's LR (multinomial logistic
regression) and DNN ([128, 64] ReLU hidden layers), float64, with
hand-written backpropagation. Parameters are one flat vector; the model knows
the shapes and hands out views (:meth:`BaselineModel.unpack`), so
perturbations and averaging are plain vector arithmetic.

Clients (:class:`BaselineClient`) are called by method name through a
:class:`fedlayer.transport.Transport`, exactly like :class:`fedlayer.client.Client`,
so the same code can run in process or under MPI. The server loop is
:func:`run_baseline`; its round records are :class:`fedlayer.timing.RoundLog`
records, as for the analytic methods (stage ``"federated"``, layer ``None``).

The package is split by job: :mod:`.models` (the networks and their
backpropagation), :mod:`.estimators` (zeroth-order gradient estimates and
their random directions), :mod:`.hyper` (default hyperparameters and their
sources), :mod:`.client` (local training, one client at a time: the
per-client engine), :mod:`.cohort` (the batched engine: all clients of a
process step together, with the per-client engine's numbers) and
:mod:`.server` (the round loop and its checkpoints).
"""

from .client import BaselineClient
from .estimators import DirectionStream, stein_gradient, zo_sphere_gradient
from .hyper import BASELINES, baseline_hyper
from .models import BaselineModel, make_baseline_model
from .server import PERSONALIZED, run_baseline

__all__ = [
    "BASELINES",
    "PERSONALIZED",
    "BaselineClient",
    "BaselineModel",
    "DirectionStream",
    "baseline_hyper",
    "make_baseline_model",
    "run_baseline",
    "stein_gradient",
    "zo_sphere_gradient",
]
