"""The batched engine: all clients of a process take each local step of a round together.

A :class:`ClientCohort` holds the clients one process hosts (all of them in a
simulation, one rank's under MPI). The first client the server asks for its
round runs the round for every member at once; the others collect their
results. The transports and the server loop are unchanged, so the batched
engine runs wherever the per-client one does.

How a round is batched
----------------------
* Parameters are stacked per client, ``W`` (C, P); each client's minibatch
  is gathered into one array ``X`` (C, B, n_features) and every layer runs
  as one stacked product over the client axis (NumPy's ``matmul``, one gemm
  per client).
* Ragged clients are grouped, never padded: clients are ordered by their
  sample counts, and only clients whose minibatches have the same number of
  rows share a stack. In an epoch-based algorithm (FedAvg, BAFFLE) the
  clients still stepping are a prefix of the stack, the full batches of a
  step one product and the shorter last batches their own. Without padding
  a client's products and sums are those of the per-client engine, shape
  for shape, which the zeroth-order estimates need: they amplify a loss's
  last bit (d / (b2 mu) times a difference of two nearby losses).
* Zeroth-order estimates evaluate a block of directions of all clients in
  one stacked forward pass (:func:`fedlayer.baselines.estimators.directional_estimate`,
  blocks of ``BLOCK_BYTES``), the first layer as ``x W_1 + s (x U_1)``.
* Each client draws its minibatches from its own generator
  (:meth:`BaselineClient.rng`) and its directions from its own stream
  (:meth:`BaselineClient.directions`), in the per-client engine's order.
* Clients are processed in chunks that keep the stacked arrays of one step
  within ``chunk_bytes``, on ``cores`` threads, one chunk per thread at a
  time, each BLAS call on one thread (NumPy releases the GIL in its
  products, draws and array arithmetic). Clients never interact within a
  round, so chunking changes nothing but memory traffic and how evenly the
  threads are loaded (the parameters are the same bit for bit); and many
  small products split over BLAS threads stall whenever another process
  holds a core, which one chunk per thread does not (the measurement is in
  docs/results/fedlayer_notes.md). The zeroth-order estimators' chunks are
  small (``ZEROTH_ORDER_STACK_BYTES``) and cut by work, the costliest
  first, so that both threads finish together (:meth:`ClientCohort._chunks`).

There is no per-client clock: each member reports the cohort's wall time
divided by the number of members as its ``compute_s``, and the result says
so (``"engine": "batched"``). Per-client compute and idle times (Fig. 5)
come from the per-client engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import numpy.typing as npt

import fastls

from .client import BaselineClient, moreau_inner_step, moreau_outer_step
from .estimators import directional_estimate
from .models import BaselineModel

__all__ = ["ClientCohort"]


def _runs(values):
    """(lo, hi) slices of the runs of equal neighbours in ``values``."""
    runs, lo = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[lo]:
            runs.append((lo, i))
            lo = i
    return runs


#: Stacked arrays of one local step a chunk of clients may hold (bytes); see :meth:`ClientCohort._chunks`.
CHUNK_BYTES = 16 << 20
#: A zeroth-order chunk's stacked parameters may take this much (bytes), so that one direction of
#: every client in the chunk, and the sum it is added to, stay in a core's cache.
ZEROTH_ORDER_STACK_BYTES = 1 << 20
#: A round's work is cut into about this many chunks per thread, so that the threads finish together.
CHUNKS_PER_CORE = 4
#: The algorithms whose clients step through epochs of their data: a client's work is its sample count.
EPOCH_BASED = ("fedavg", "baffle")
#: The algorithms that estimate gradients from directions.
ZEROTH_ORDER = ("baffle", "fedzo", "pfedzo")
#: Directions of a chunk drawn and evaluated at a time (bytes): a block is read back from cache.
BLOCK_BYTES = 4 << 20


class ClientCohort:
    """The batched engine over ``clients`` (:class:`~fedlayer.baselines.BaselineClient` of one process).

    Parameters
    ----------
    clients : sequence of BaselineClient
        Same model on every client. Each is joined to this cohort (its
        ``local_train`` then runs here).
    cores : int or None
        Threads the chunks of clients run on, each with one BLAS thread
        (default: the most cores any member has).
    chunk_bytes : int, default=CHUNK_BYTES
        Memory the stacked arrays of one step may take; the clients are
        processed in chunks that fit.

    Raises
    ------
    ValueError
        No clients, or clients with different models.
    """

    model: BaselineModel
    members: list[BaselineClient]
    cores: int
    chunk_bytes: int

    def __init__(self, clients: Iterable[BaselineClient], cores: int | None = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        clients = list(clients)
        if not clients:
            raise ValueError("a cohort needs at least one client")
        model = clients[0].model
        for client in clients[1:]:
            if client.model.layer_sizes != model.layer_sizes:
                raise ValueError(f"a cohort's clients share one model; client {client.client_id} has layers "
                                 f"{client.model.layer_sizes}, client {clients[0].client_id} {model.layer_sizes}")
        self.model = model
        # Most samples first: in an epoch the clients still stepping are a prefix of the stack.
        self.members = sorted(clients, key=lambda c: (-c.data.n_train, c.client_id))
        self.cores = int(cores or max(c.cores for c in clients))
        self.chunk_bytes = int(chunk_bytes)
        self._inputs = [c.data.x_train.reshape(c.data.n_train, -1) for c in self.members]
        self._round = None      # (algorithm, round, hyper) of the round whose results wait in _pending
        self._params = None
        self._pending = {}      # cid -> result dict of the round in _round
        self._local = threading.local()  # per thread: name -> flat float64 array reused across steps (_buffer)
        for client in clients:
            client.cohort = self

    # -- what a member's local_train calls -------------------------------------
    def local_train(self, client: BaselineClient, algorithm: str, params: npt.ArrayLike, round_index: int,
                    hyper: Mapping[str, Any]) -> dict[str, Any]:
        """``client``'s result of this round, running the round for every member first if it has not run.

        The arguments are those of :meth:`BaselineClient.local_train` (``hyper`` as a dict); so is the
        result, with ``"engine": "batched"`` and the cohort's wall time per member as ``"compute_s"``.
        """
        key = (algorithm, int(round_index), tuple(sorted(hyper.items())))
        if key != self._round or client.client_id not in self._pending or not np.array_equal(params, self._params):
            self._run(algorithm, params, int(round_index), hyper)
            self._round, self._params = key, np.array(params, dtype=np.float64)
        return self._pending.pop(client.client_id)

    def _run(self, algorithm, params, round_index, hyper):
        self._round, self._pending = None, {}  # nothing cached until the whole round has run
        w = np.array(params, dtype=np.float64)
        pending = {}
        step = getattr(self, f"_{algorithm}")

        def train(bounds):
            lo, hi = bounds
            rngs = [c.rng(round_index, algorithm) for c in self.members[lo:hi]]
            streams = [c.directions(round_index, algorithm) for c in self.members[lo:hi]]
            with np.errstate(over="ignore", invalid="ignore"):  # per thread; as in BaselineClient.local_train
                return bounds, step(lo, rngs, streams, np.repeat(w[None], hi - lo, axis=0), **hyper)

        start = time.perf_counter()
        with fastls.limit_cores(1), ThreadPoolExecutor(self.cores) as pool:
            for (lo, hi), (W, theta) in pool.map(train, self._chunks(algorithm, hyper)):
                for i, client in enumerate(self.members[lo:hi]):
                    client.params = W[i]
                    if theta is not None:
                        client.theta = theta[i]
                    pending[client.client_id] = {"params": W[i], "n": client.data.n_train}
        share = (time.perf_counter() - start) / len(self.members)
        for result in pending.values():
            result["compute_s"] = share
            result["engine"] = "batched"
        self._pending = pending

    def _chunks(self, algorithm, hyper):
        """(lo, hi) slices of the members, the costliest first, that keep the threads equally busy.

        A chunk holds at most what fits ``chunk_bytes`` (and, for the
        zeroth-order estimators, ``ZEROTH_ORDER_STACK_BYTES`` of parameters),
        and, for those, at most 1 / (``CHUNKS_PER_CORE`` cores) of the round's
        work unless one client alone has more: a client's work is its sample
        count in BAFFLE (epochs over its data) and one share in FedZO and
        pFedZO (the same number of steps for all). The gradient algorithms'
        steps cost mostly Python's overhead, so they take the fewest chunks
        that fit, at least one per thread. With minibatches of a fixed size
        (FedZO, pFedMe, pFedZO) a chunk also holds only clients whose batches
        have the same number of rows.
        """
        params_bytes = self.model.n_params * 8
        size = max(1, self.chunk_bytes // (params_bytes * 6))  # W, theta, the gradient and NumPy's temporaries
        # The local updates' own default (20) where the caller leaves the batch size to them.
        batch = hyper.get("b1" if algorithm == "fedzo" else "batch_size", 20)
        rows = [min(int(batch), c.data.n_train) if algorithm not in EPOCH_BASED else 0 for c in self.members]
        work = [c.data.n_train if algorithm in EPOCH_BASED else 1 for c in self.members]
        if algorithm in ZEROTH_ORDER:
            size = min(size, max(1, ZEROTH_ORDER_STACK_BYTES // params_bytes))
            share = sum(work) / (CHUNKS_PER_CORE * self.cores)
        else:
            # A gradient step is mostly Python's overhead at these sizes: the fewest chunks, one per thread at least.
            size = min(size, -(-len(self.members) // self.cores))
            share = float("inf")
        chunks = []
        for lo, hi in _runs(rows):
            first, load = lo, 0
            for i in range(lo, hi):
                if i > first and (i - first >= size or load + work[i] > share):
                    chunks.append((first, i))
                    first, load = i, 0
                load += work[i]
            chunks.append((first, hi))
        # The threads take chunks in this order: the costliest first, the smallest to fill in at the end.
        return sorted(chunks, key=lambda c: -sum(work[c[0]:c[1]]))

    # -- stacked data and draws -------------------------------------------------
    def _gather(self, lo, rows):
        """Minibatches of members lo, lo+1, ... (rows: their row indices, all of one length) as one stack."""
        x = np.stack([self._inputs[lo + i][r] for i, r in enumerate(rows)]).astype(np.float64, copy=False)
        y = np.stack([self.members[lo + i].data.y_train[r] for i, r in enumerate(rows)])
        return x, y

    def _buffer(self, name, shape):
        """This thread's reused float64 array of ``shape`` (fresh ones cost a page fault per 4 kB at every step)."""
        size = int(np.prod(shape))
        buffers = self._local.__dict__.setdefault("buffers", {})
        flat = buffers.get(name)
        if flat is None or flat.size < size:
            flat = buffers[name] = np.empty(size)
        return flat[:size].reshape(shape)

    def _sampled(self, lo, rngs, size):
        return self._gather(lo, [self.members[lo + i].sample(rng, size) for i, rng in enumerate(rngs)])

    def _grad(self, W, batch):
        return self.model.stacked_grad(W, *batch, out=self._buffer("grad", W.shape))

    def _estimate(self, streams, W, batch, count, step, sphere):
        """Zeroth-order estimates (C, P) at W (C, P), each client on its batch (see directional_estimate)."""
        f0, losses = self.model.directional_losses(W, *batch)
        block = max(1, min(int(count), BLOCK_BYTES // (W.nbytes or 1)))
        return directional_estimate(f0, losses, streams, count, step, sphere=sphere,
                                    buffer=self._buffer("directions", (len(W), block, W.shape[1])),
                                    out=self._buffer("grad", W.shape), work=self._buffer("work", W.shape))

    # -- the five local updates, each over members lo, lo + 1, ... (one per generator) ---
    def _epochs(self, lo, rngs, streams, W, batch_size, local_epochs, grad):
        """Epoch passes of minibatch steps ``W -= grad(...)``; the clients still stepping are a prefix."""
        b = int(batch_size)
        for _ in range(int(local_epochs)):
            orders = [rng.permutation(self.members[lo + i].data.n_train) for i, rng in enumerate(rngs)]
            for s in range(0, len(orders[0]), b):
                rows = [order[s:s + b] for order in orders if len(order) > s]
                for a, z in _runs([len(r) for r in rows]):  # the full batches, then each length of last batch
                    W[a:z] -= grad(streams[a:z], W[a:z], self._gather(lo + a, rows[a:z]))
        return W

    def _fedavg(self, lo, rngs, streams, W, *, lr, batch_size, local_epochs=1):
        def step(streams, W, batch):
            g = self._grad(W, batch)
            g *= lr
            return g

        return self._epochs(lo, rngs, streams, W, batch_size, local_epochs, step), None

    def _baffle(self, lo, rngs, streams, W, *, lr, batch_size, K=100, sigma=1e-4, clip=0.3, local_epochs=1):
        def step(streams, W, batch):
            g = self._estimate(streams, W, batch, K, sigma, sphere=False)
            if clip is not None:
                np.clip(g, -clip, clip, out=g)
            g *= lr
            return g

        return self._epochs(lo, rngs, streams, W, batch_size, local_epochs, step), None

    def _fedzo(self, lo, rngs, streams, W, *, lr, local_iters, b1, b2=20, mu=1e-3):
        for _ in range(int(local_iters)):
            g = self._estimate(streams, W, self._sampled(lo, rngs, b1), b2, mu, sphere=True)
            g *= lr
            W -= g
        return W, None

    def _moreau(self, lo, rngs, W, inner_grad, *, lr, personal_lr, lamda, K=5, batch_size=20, local_epochs=20):
        """pFedMe's local rounds: K inner steps of theta on ``inner_grad`` per batch, then one outer step of W."""
        theta = W.copy()
        work = self._buffer("moreau", W.shape)
        for _ in range(int(local_epochs)):
            batch = self._sampled(lo, rngs, batch_size)
            for _ in range(int(K)):
                moreau_inner_step(theta, W, inner_grad(theta, batch), personal_lr, lamda, work)
            moreau_outer_step(W, theta, lr, lamda, work)
        return W, theta

    def _pfedme(self, lo, rngs, streams, W, **moreau):
        """:meth:`_moreau` on exact gradients; ``moreau``: its hyperparameters."""
        return self._moreau(lo, rngs, W, self._grad, **moreau)

    def _pfedzo(self, lo, rngs, streams, W, *, b2=20, mu=1e-3, **moreau):
        """:meth:`_moreau` on zeroth-order estimates over ``b2`` sphere directions at smoothing ``mu``."""
        return self._moreau(lo, rngs, W, lambda theta, batch: self._estimate(streams, theta, batch, b2, mu, True),
                            **moreau)
