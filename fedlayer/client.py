"""The client side of FedACnnL / pFedACnnL: local statistics, weights, personalization.

A client owns its data and its copy of the model. Everything it does is
called by the server through a transport (in-process or MPI), by method name,
so the same code runs in both.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import shutil
import tempfile
import time
import weakref
from pathlib import Path
from collections.abc import Sequence

import numpy as np

import fastls

from .checkpoint import load_personal_layer, personal_layer_path, save_personal_layer
from .data import ClientData, one_hot
from .models import Model
from .options import CLIENT_SCRATCH_BYTES, CONV_TARGETS, EPS_CRITERIA, FORWARD_MODES, ClientOptions
from .rotation import haar_orthogonal

__all__ = ["Client", "ClientDropout", "label_encoders", "encoder_widths", "target_bases", "encoder_for_clustering",
           "init_weights", "CLIENT_SCRATCH_BYTES", "CONV_TARGETS", "EPS_CRITERIA", "FORWARD_MODES"]

#: The widest activation of one forward step: half a 32 MiB last-level cache, so that a memory-bound
#: convolution runs its activation and pooling in cache (docs/results/protocol_notes.md).
FORWARD_STEP_BYTES = 16 * 2**20

#: eps="auto" takes exact leave-one-out below this many rows per feature and GCV
#: from the statistics at or above it (n >> d: every leverage is about d / n, the
#: criteria agree, and leave-one-out's pass over the rows per candidate eps
#: would cost more than the personalization). Below it GCV's choices cost accuracy
#: (docs/results/protocol_notes.md).
GCV_ROWS_PER_FEATURE = 32


class ClientDropout(RuntimeError):
    """A client left a round: a simulated failure (``drop_probability``) or a missed round deadline."""


def _reserve_blocks(path):
    """Allocate every block of the file now, so that a full disk is an error here.

    A memory-mapped file is created sparse: without its blocks, a write
    through the mapping on a full disk kills the process with SIGBUS (a
    full-width pFedACnnL run died so, at 24 GB of cached activations).
    Filesystems that cannot reserve blocks keep the sparse file.
    """
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        try:
            os.posix_fallocate(f.fileno(), 0, size)
        except OSError as err:
            if err.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return
            message = (f"cannot reserve {size / 2**20:.1f} MiB for cached activations in {path.parent} "
                       f"({os.strerror(err.errno)}); free space there, or run with --output on a disk with room "
                       f"(without it the cache is under $TMPDIR)")
            raise OSError(err.errno, message, str(path)) from None


def label_encoders(seed: int, n_classes: int, widths: Sequence[int]) -> list[np.ndarray]:
    """The set Q = {Q_l} of label-encoding matrices, identical on every client.

    Parameters
    ----------
    seed : int
        The seed the server broadcasts (Algorithm 1, line 1).
    n_classes : int
    widths : list of int
        Output width d_l of every trainable layer; the last one (the output
        layer, whose target is Y itself) gets no encoder.

    Returns
    -------
    list of ndarray of shape (n_classes, d_l), float64, standard normal, read-only
        The same arrays for every caller with these arguments: codes per
        output position of the full-width DCNN take 47 MB, which a hundred
        clients in one process share instead of copying.
    """
    return list(_shared_encoders(int(seed), int(n_classes), tuple(int(w) for w in widths)))


@functools.lru_cache(maxsize=4)
def _shared_encoders(seed, n_classes, widths):
    rng = np.random.default_rng([seed, 0x51])
    return tuple(_read_only(rng.standard_normal((n_classes, width))) for width in widths[:-1])



def encoder_widths(model: Model, conv_targets: str = "position") -> list[int]:
    """d_l of every trainable layer: the width its label encoder Q_l must have.

    d_l is the width of the layer's output per sample (the paper's Z_l in
    R^{N x d_l}): the units of a dense layer, and out_h x out_w x filters for
    a convolution with ``conv_targets="position"``, so that every output
    position has its own code of the label. ``"image"`` gives a convolution
    one code of width filters, repeated at every position.
    """
    if conv_targets not in CONV_TARGETS:
        raise ValueError(f"conv_targets must be one of {CONV_TARGETS}, got {conv_targets!r}")
    widths = []
    for index in model.trainable:
        layer = model.layers[index]
        input_shape = model.input_shape_of(index)
        width = layer.ls_shape(input_shape)[1]
        if conv_targets == "position":
            width *= layer.rows_per_sample(input_shape)
        widths.append(width)
    return widths


def personalization_costs(layer, input_shape: tuple, n_samples: int, basis: np.ndarray | None) -> dict:
    """Flops of a client's proximal solve of ``layer`` in each form (:func:`fastls.proximal_cost`).

    ``n_samples`` training samples give ``rows_per_sample`` least-squares rows
    each; with encoded targets (``basis``, see :func:`target_bases`) the
    right-hand sides have the basis's columns, not the layer's outputs. A
    client takes the dual form where ``costs["dual"] < costs["primal"]``.
    """
    n_in, n_out = layer.ls_shape(input_shape)
    n_rhs = n_out if basis is None else basis.shape[0]
    return fastls.proximal_cost(n_samples * layer.rows_per_sample(input_shape), n_in, n_rhs,
                                gram_flops=layer.gram_flops(input_shape, n_samples))


def target_bases(model: Model, seed: int, conv_targets: str = "position") -> list[np.ndarray | None]:
    """Per trainable layer, the basis its targets are encoded in: Q_l in the model dtype, or None.

    Hidden-layer targets are Z_l = Y Q_l, so X^T Z_l = (X^T Y) Q_l and every
    solve can run on the n_classes columns of its coordinates in Q_l (the
    ``rhs_basis`` of the fastls solves). A convolution coded per position
    gives the rows of output position p the code Q_l,p (n_classes x
    filters), so X^T Z_l = sum_p (X_p^T Y) Q_l,p lies in the row space of
    the stacked codes, (positions x n_classes, filters), row p * n_classes + c
    holding Q_l,p's row c. None where the basis would be no narrower than the
    layer (it saves nothing), and for the output layer.
    """
    widths = encoder_widths(model, conv_targets)
    n_classes = widths[-1]
    bases = []
    for index, Q in zip(model.trainable, label_encoders(seed, n_classes, widths)):
        positions = model.layers[index].rows_per_sample(model.input_shape_of(index)) \
            if conv_targets == "position" else 1
        stacked = Q.reshape(n_classes, positions, -1).transpose(1, 0, 2).reshape(positions * n_classes, -1)
        bases.append(stacked.astype(model.dtype) if stacked.shape[0] < stacked.shape[1] else None)
    return bases + [None]


def encoder_for_clustering(encoders: Sequence[np.ndarray], n_classes: int) -> np.ndarray:
    """Q_enc: the encoder of the narrowest layer (eq. 8).

    A one-layer model (LR) has no hidden encoder; the identity is used then,
    so h_i is the client's normalized label histogram.
    """
    if not encoders:
        return np.eye(n_classes)
    return min(encoders, key=lambda Q: Q.shape[1])


def init_weights(model: Model, seed: int) -> None:
    """Seeded initial weights (scaled normal), identical on every client.

    FedACnnL replaces every layer's weights, so the initial ones only matter
    for the per-round accuracy of a model whose later layers are untrained.
    The arrays are read-only and shared by every model of the same
    configuration and seed in this process (250 MB for the full-width DCNN,
    once, not once per client).
    """
    for index, W in zip(model.trainable, _initial_weights(json.dumps(model.config(), sort_keys=True), seed)):
        model.layers[index].set_weights(W)


@functools.lru_cache(maxsize=4)
def _initial_weights(config_json, seed):
    model = Model.from_config(json.loads(config_json))
    rng = np.random.default_rng([seed, 0x1A])
    weights = []
    for index in model.trainable:
        n_in, n_out = model.layers[index].ls_shape(model.input_shape_of(index))
        weights.append(_read_only((rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(model.dtype)))
    return weights


def _read_only(A):
    A = np.ascontiguousarray(A)
    A.flags.writeable = False
    return A


#: Server weights cast to a model dtype, shared by the clients of one process:
#: id(server array) -> (weak reference to it, read-only cast).
_SHARED_CASTS = {}


def _shared_cast(W, dtype):
    """A read-only W in ``dtype``, one copy per server array however many clients install it."""
    if W.flags.writeable or (W.dtype == dtype and W.flags.c_contiguous):
        return W  # the layer copies a writeable W, and shares a read-only one as it is
    for key in [k for k, (ref, _) in _SHARED_CASTS.items() if ref() is None]:
        del _SHARED_CASTS[key]
    ref, cast = _SHARED_CASTS.get(id(W), (None, None))
    if ref is None or ref() is not W:
        cast = _read_only(W.astype(dtype))
        _SHARED_CASTS[id(W)] = (weakref.ref(W), cast)
    return cast


#: The layer whose statistics the arrays recycled in this process (fastls.recycled_array) were
#: last sized for; a client of another layer releases them first.
_RECYCLED_FOR_LAYER = None


def _load_parked(path):
    """Weights parked in ``path``: a cache's .npy file, or a checkpoint's personalized layer (.npz)."""
    if Path(path).suffix == ".npz":
        with np.load(path) as stored:
            return stored["weights"]
    return np.load(path)


def _remove_files(paths):
    for path in list(paths):
        path.unlink(missing_ok=True)


class Client:
    """One federated client.

    Parameters
    ----------
    client_id : int
    data : ClientData
        Local train/test split; x of shape (n, *feature_shape).
    model_config : dict
        ``Model.config()`` of the shared architecture.
    seed : int
        Broadcast seed: label encoders and initial weights.
    n_classes : int
    cores : int
        Cores this client may use; its local computation runs under
        ``fastls.limit_cores(cores)`` (the paper's 1-4-core edge devices).
    options : ClientOptions, default=ClientOptions()
        How it computes, caches and fails (:class:`fedlayer.options.ClientOptions`;
        :meth:`~fedlayer.options.ClientOptions.from_config` for a run's).

    Raises
    ------
    ValueError
        ``data`` has no training samples: such a client has no statistics to
        send and no label summary to group it by.

    Notes
    -----
    Layer-wise training passes every sample through each layer once per
    stage: the client keeps, per split, the input of the layer it will
    train or evaluate next, and moves it one trained layer forward when
    needed. Replacing the weights of a layer the cached activations went
    through drops them (personalization starts again from the raw data).
    """

    def __init__(self, client_id: int, data: ClientData, model_config: dict, seed: int, n_classes: int,
                 cores: int = 1, options: ClientOptions | None = None) -> None:
        options = ClientOptions() if options is None else options
        self.options = options
        self.client_id = int(client_id)
        if data.n_train == 0:
            raise ValueError(f"client {client_id} has no training samples; a client needs at least one (it has "
                             f"no statistics to send, nor a label summary to be grouped by)")
        self.data = data
        self.model = Model.from_config(model_config)
        self.seed = int(seed)
        self.n_classes = int(n_classes)
        data.check_classes(self.n_classes)
        self.cores = int(cores)
        self.stat_dtype = np.dtype(options.stat_dtype)
        self.scratch_bytes = int(options.scratch_bytes)
        init_weights(self.model, self.seed)
        self.conv_targets = options.conv_targets
        self.eps_criterion = options.eps_criterion
        self.forward = options.forward
        self.drop_probability = float(options.drop_probability)
        self.round_deadline_s = None if options.round_deadline_s is None else float(options.round_deadline_s)
        self.h_noise = float(options.h_noise)
        conv_targets = options.conv_targets
        self.encoders = label_encoders(self.seed, self.n_classes, encoder_widths(self.model, conv_targets))
        self.bases = target_bases(self.model, self.seed, conv_targets)
        self.meta_weights = {}  # position -> the group's meta-model weights, kept for personalization
        self.personal_choices = {}  # position -> what a private personalization chose (eps, form): kept here
        self.cache_ram_bytes = int(options.cache_ram_bytes)
        self._cache_dir = Path(options.cache_dir) if options.cache_dir is not None else None
        if self._cache_dir is not None:
            # Files a killed process left for this client (a resumed run names its files anew): its
            # finalizers never ran, and nothing else would remove them.
            _remove_files(set(self._cache_dir.glob(f"client{self.client_id}_*.npy")))
        self._activations = {}  # split -> (layer index whose input it is, array or .npy path)
        self._files = set()     # .npy files of this client, removed when it is dropped or collected
        self._parked = {}       # layer index -> .npy file of its personalized weights (see _resident)
        weakref.finalize(self, _remove_files, self._files)
        self._evaluated_upto = 0  # layers[:k] hold the weights evaluation should cache through
        # The first core limit in a process builds threadpoolctl's controller
        # (it inspects every loaded library); do it now, outside the timed rounds.
        fastls.blas_info()

    # -- helpers -----------------------------------------------------------
    def _targets(self, position, labels):
        """Z_l = Y Q_l for a hidden layer, Y for the output layer.

        Shape (B, m), or (B, out_h, out_w, m) for a convolution coded per position.
        """
        Y = one_hot(labels, self.n_classes, dtype=self.model.dtype)
        if position >= len(self.encoders):
            return Y
        Z = fastls.matmul(Y, self.encoders[position].astype(self.model.dtype, copy=False), check_finite=False)
        shape = self._position_shape(position)
        return Z if shape is None else Z.reshape(len(Y), *shape)

    def _position_shape(self, position):
        """(out_h, out_w, m) when layer ``position``'s label code differs per output position, else None."""
        if self.conv_targets != "position" or position >= len(self.encoders):
            return None
        index = self.model.trainable[position]
        layer = self.model.layers[index]
        input_shape = self.model.input_shape_of(index)
        return tuple(layer.output_shape(input_shape)) if layer.rows_per_sample(input_shape) > 1 else None

    def _position_basis(self, position):
        """Q_l as (out_h, out_w, n_classes, m) for :class:`fastls.ConvStats` (one-hot coordinates), or None."""
        shape = self._position_shape(position)
        if shape is None:
            return None
        return self.encoders[position].reshape(self.n_classes, *shape).transpose(1, 2, 0, 3)

    def _coordinate_basis(self, position):
        """Identity (out_h, out_w, n_classes, positions x n_classes) of a convolution coded per position, or None.

        Given to :class:`fastls.ConvStats` as the position basis, it turns a
        sample's one-hot label into the one-hot coordinate of (position,
        class) at each output position, so C = X^T Y in the row order of
        :func:`target_bases` (row p * n_classes + c).
        """
        shape = self._position_shape(position)
        if shape is None:
            return None
        out_h, out_w, _ = shape
        k = out_h * out_w * self.n_classes
        return np.eye(k, dtype=self.model.dtype).reshape(out_h, out_w, self.n_classes, k)

    def _row_targets(self, position, labels):
        """The targets of the layer's least-squares rows, (len(labels) x rows per sample, m)."""
        Z = self._targets(position, labels)
        if Z.ndim > 2:
            return Z.reshape(-1, Z.shape[-1])
        index = self.model.trainable[position]
        return np.repeat(Z, self.model.layers[index].rows_per_sample(self.model.input_shape_of(index)), axis=0)

    # -- activations, one pass per layer and stage -----------------------
    def _split(self, split):
        return (self.data.x_train, self.data.y_train) if split == "train" else (self.data.x_test, self.data.y_test)

    def _layer_inputs(self, split, layer_index, tap=None):
        """Inputs of ``layers[layer_index]`` for every sample of the split, from the cache.

        Moves the cached activations forward through the layers they have
        not passed yet (the only forward computation), or starts from the
        raw samples when the cache is past ``layer_index``. ``tap``, a pair
        (i, callback): when the cache moves on from the input of the trainable
        ``layers[i]``, ``callback(s, z)`` sees each batch's pre-activation z of
        that layer (samples s, s + 1, ...) before the layer's activation
        overwrites it.
        """
        start, stored = self._activations.get(split, (0, None))
        if stored is None or start > layer_index:
            start, stored = 0, self._split(split)[0]
        x = np.load(stored, mmap_mode="r") if isinstance(stored, Path) else stored
        if start == layer_index:
            return x
        out = self._new_activations(split, layer_index, len(x))
        step = self._forward_rows(start, layer_index)
        for s in range(0, len(x), step):
            h, first = x[s:s + step], start
            if tap is not None and tap[0] == start:
                layer = self.model.layers[start]
                z = layer.pre_activation(h)
                tap[1](s, z)
                h, first = layer.activation.apply_inplace(z), start + 1
            out[s:s + step] = self.model.forward(h, start=first, stop=layer_index)
        if isinstance(out, np.memmap):
            # No flush: the file is read back by this process through the page
            # cache, and a synchronous msync is slow (docs/results/protocol_notes.md).
            path = Path(out.filename)
            del out
            self._drop(split)
            self._activations[split] = (layer_index, path)
            return np.load(path, mmap_mode="r")
        self._drop(split)
        self._activations[split] = (layer_index, out)
        return out

    def _new_activations(self, split, layer_index, n):
        shape = (n, *self.model.input_shape_of(layer_index))
        nbytes = int(np.prod(shape)) * self.model.dtype.itemsize
        if nbytes <= self.cache_ram_bytes:
            return np.empty(shape, dtype=self.model.dtype)
        path = self._cache_path(f"{split}_layer{layer_index}")
        out = np.lib.format.open_memmap(path, mode="w+", dtype=self.model.dtype, shape=shape)
        try:
            _reserve_blocks(path)
        except OSError:
            del out
            path.unlink(missing_ok=True)
            raise
        return out

    def _cache_path(self, name):
        """A file of this client under the cache folder, removed with the client."""
        if self._cache_dir is None:
            self._cache_dir = Path(tempfile.mkdtemp(prefix=f"fedlayer-client{self.client_id}-"))
            weakref.finalize(self, shutil.rmtree, self._cache_dir, True)
        self._cache_dir.mkdir(parents=True, exist_ok=True)
        path = self._cache_dir / f"client{self.client_id}_{name}.npy"
        self._files.add(path)
        return path

    @contextlib.contextmanager
    def _resident(self):
        """Personalized weights parked on disk are in the model for the duration of one call.

        A hundred simulated clients of the full-width DCNN would hold 25 GB of
        personalized weights; between calls each client keeps its own on disk
        (the weights it shares with its group stay in memory once).
        """
        layers = self.model.layers
        for index, path in self._parked.items():
            layers[index].set_weights(_read_only(_load_parked(path)))
        try:
            yield
        finally:
            for index in self._parked:
                layers[index].weights = None

    def _install_personal(self, layer_index, W, kept=None):
        """Make W the personalized weights of ``layers[layer_index]``; parked on disk when too large to hold.

        ``kept``: a checkpoint's file that already holds W (:func:`fedlayer.checkpoint.save_personal_layer`),
        parked on instead of writing W again.
        """
        layer = self.model.layers[layer_index]
        layer.set_weights(W)
        self._parked.pop(layer_index, None)
        if layer.weights.nbytes > self.cache_ram_bytes:
            if kept is None:
                kept = self._cache_path(f"weights_layer{layer_index}")
                np.save(kept, layer.weights)
            self._parked[layer_index] = kept
        self._weights_changed(layer_index)

    def _drop(self, split):
        _, stored = self._activations.pop(split, (0, None))
        if isinstance(stored, Path):
            _remove_files({stored})
            self._files.discard(stored)

    def _forward_rows(self, start, stop):
        """Samples per forward call: the widest activation of one call stays near FORWARD_STEP_BYTES."""
        widest = max(int(np.prod(self.model.input_shape_of(i))) for i in range(start, stop + 1))
        return max(1, FORWARD_STEP_BYTES // (widest * self.model.dtype.itemsize))

    def _weights_changed(self, layer_index):
        """Drop the activations that went through layers[layer_index]; evaluate from its successor on."""
        for split in list(self._activations):
            if self._activations[split][0] > layer_index:
                self._drop(split)
        # Evaluation caches through this layer and the parameter-free layers
        # after it, up to the next trainable one (whose weights are not final yet).
        self._evaluated_upto = self._next_trainable(layer_index)

    def _next_trainable(self, layer_index):
        """Index of the first trainable layer after ``layers[layer_index]`` (the model's length if none)."""
        return next((i for i in self.model.trainable if i > layer_index), len(self.model.layers))

    def _statistics(self, position, batch_size, rng, coordinates=False):
        """(X_l^T X_l, X_l^T Z_l) over the local training set, batch by batch (eq. 6).

        With ``coordinates`` the second item is X_l^T Y's coordinates in the
        layer's label code instead (:func:`target_bases`; k < m columns), from
        which X_l^T Z_l = (X_l^T Y) Q_l.

        Returns G, C and the seconds spent on the forward pass and on the statistics.
        """
        layer_index = self.model.trainable[position]
        layer = self.model.layers[layer_index]
        n_in, n_out = layer.ls_shape(self.model.input_shape_of(layer_index))
        per_batch = self.forward == "batch"
        start = time.perf_counter()
        x = self.data.x_train if per_batch else self._layer_inputs("train", layer_index)
        forward_rows = self._forward_rows(0, layer_index) if per_batch else None
        forward_s = time.perf_counter() - start
        if coordinates and self.bases[position] is None:
            raise ValueError(f"client {self.client_id}: layer {position + 1} has no label code narrower than its "
                             f"{n_out} outputs, so X^T Y has no coordinates to upload; ask for X^T Z")
        width = self.bases[position].shape[0] if coordinates else n_out
        global _RECYCLED_FOR_LAYER
        if _RECYCLED_FOR_LAYER != layer_index:
            # Arrays recycled for another layer have other shapes, so nothing would reuse them; held,
            # layer 4's overlap products sat beside the two 8.6 GB Grams of a wide classifier.
            fastls.release_recycled()
            _RECYCLED_FOR_LAYER = layer_index
        # The previous client's uploads, once summed, lend their memory (first-touch zeroing of
        # fresh pages cost ~1 s per client at d = 18,433).
        G = fastls.recycled_array("fedlayer.statistics.G", (n_in, n_in), self.stat_dtype)
        C = fastls.recycled_array("fedlayer.statistics.C", (n_in, width), self.stat_dtype)
        order = rng.permutation(self.data.n_train) if rng is not None else np.arange(self.data.n_train)
        basis = self._coordinate_basis(position) if coordinates else self._position_basis(position)
        one_hot_labels = coordinates or basis is not None
        with layer.statistics(G, C, scratch_bytes=self.scratch_bytes, samples=len(order), position_basis=basis,
                              target_width=width if coordinates and basis is None else None) as stats:
            for first in range(0, len(order), batch_size):
                # Sorted within a batch: the rows are read in file order from a memory map.
                batch = np.sort(order[first:first + batch_size])
                labels = self.data.y_train[batch]
                rows = x[batch]
                if per_batch:
                    begin = time.perf_counter()
                    rows = self.model.forward(rows, layer_index, forward_rows)
                    forward_s += time.perf_counter() - begin
                # Codes per position, and coordinates, go in as one-hot labels.
                stats.update(rows, one_hot(labels, self.n_classes, dtype=self.model.dtype) if one_hot_labels
                             else self._targets(position, labels))
        return G, C, forward_s, time.perf_counter() - start - forward_s

    def _target_moments(self, position):
        """(tr(Z_l^T Z_l), rows of X_l) over the local training set: what GCV needs besides G and C.

        tr(Z^T Z) = sum over classes of (samples of the class) x (squared norm of
        the targets of one such sample over all its rows: every patch of an
        image, each with its own code when coded per position).
        """
        layer_index = self.model.trainable[position]
        rows_per_sample = self.model.layers[layer_index].rows_per_sample(self.model.input_shape_of(layer_index))
        counts = np.bincount(self.data.y_train, minlength=self.n_classes).astype(np.float64)
        per_class = self._row_targets(position, np.arange(self.n_classes)).astype(np.float64)
        per_class = per_class.reshape(self.n_classes, -1)  # a class's targets over all its rows
        zz = float(counts @ np.einsum("ij,ij->i", per_class, per_class))
        return zz, self.data.n_train * rows_per_sample

    # -- methods the server calls -------------------------------------------
    def label_summary(self) -> dict:
        """h_i = (mean label vector of the local training set) Q_enc (eq. 9), plus N(0, h_noise^2) noise.

        h_i travels in the clear and tells the server the client's label mix;
        the noise (from the operating system's randomness, not the run's seed:
        the server knows the seed) blurs it at the cost of worse groups.
        """
        Y = one_hot(self.data.y_train, self.n_classes, dtype=np.float64)
        h = Y.mean(axis=0) @ encoder_for_clustering(self.encoders, self.n_classes)
        if self.h_noise:
            noise = np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
            h = h + noise.normal(0.0, self.h_noise, size=h.shape)
        return {"h": h}

    def local_stats(self, position: int, batch_size: int, round_index: int = 0, target_moments: bool = False,
                    coordinates: bool = False) -> dict:
        """Local computation of one round: the two items uploaded to the server.

        Batches of ``batch_size`` samples are drawn without replacement in a
        seeded random order; the sums do not depend on it (weight invariance).
        With ``target_moments`` the upload also holds ``zz`` = tr(Z^T Z) and
        ``rows``, the two numbers the server's GCV choice of gamma needs.
        With ``coordinates``, C is X^T Y's coordinates in the layer's label
        code (:data:`fedlayer.options.UPLOAD_MODES`).
        """
        if batch_size < 1:
            raise ValueError(f"client {self.client_id}: batch_size must be >= 1, got {batch_size}")
        self._simulated_failure(position, round_index)
        rng = np.random.default_rng([self.seed, self.client_id, round_index])
        start = time.perf_counter()
        with self._resident(), fastls.limit_cores(self.cores):
            G, C, forward_s, stats_s = self._statistics(position, int(batch_size), rng, bool(coordinates))
            upload = {"G": G, "C": C}
            if target_moments:
                upload["zz"], upload["rows"] = self._target_moments(position)
        compute_s = time.perf_counter() - start
        self._check_deadline(position, compute_s)
        return {**upload, "n": self.data.n_train, "compute_s": compute_s,
                "parts": {"forward_s": forward_s, "stats_s": stats_s}}

    def _simulated_failure(self, position, round_index):
        """Raise ClientDropout when this client's seeded draw fails it in this round."""
        if self.drop_probability and np.random.default_rng([self.seed, self.client_id, round_index, 0xD0]).random() \
                < self.drop_probability:
            raise ClientDropout(f"client {self.client_id}: simulated failure in layer {position + 1} "
                                f"(drop probability {self.drop_probability:g})")

    def _check_deadline(self, position, compute_s):
        if self.round_deadline_s is not None and compute_s > self.round_deadline_s:
            # Computed, but too late: the server has moved on without it.
            raise ClientDropout(f"client {self.client_id}: busy {compute_s:.3f} s in layer {position + 1}, past the "
                                f"round deadline of {self.round_deadline_s:g} s")

    def train_rows(self) -> dict:
        """How many least-squares rows each trainable layer has here: what the server's cost rule needs.

        Returns ``{"rows": [n_train x rows per sample of each trainable layer]}``.
        """
        return {"rows": [self.data.n_train * self.model.layers[index].rows_per_sample(self.model.input_shape_of(index))
                         for index in self.model.trainable]}

    def factored_rows(self, position: int, batch_size: int, round_index: int = 0, coordinates: bool = False) -> dict:
        """One round's upload for the server's dual solve: the rows themselves, behind a secret rotation.

        F = U X (the model's dtype) and UZ = U Z (``stat_dtype``) over all the
        layer's least-squares rows X (n x d, every batch of eq. (7) together:
        ``batch_size`` only sets the dropout and deadline rules' round) and
        their targets Z, with U a fresh n x n Haar-random orthogonal matrix
        from the client's own secret randomness
        (:func:`fedlayer.rotation.haar_orthogonal`), never the run's seed.
        F^T F = X^T X and F^T UZ = X^T Z: the server learns what
        :meth:`local_stats` would tell it. With ``coordinates`` Z is the
        rows' one-hot coordinates in the layer's label code, as
        :meth:`local_stats` uploads X^T Y's.

        A client with ``options.rotate_rows`` off (the centralized
        reference's pooled client) sends X and Z as they are. The rows come
        from the cached layer inputs whatever ``options.forward`` says: all
        of them are factored at once, so there is no batch to forward.

        A client that fails the round (simulated, or past its deadline)
        returns ``{"dropout": why}`` instead of raising: the round goes on
        without its rows.

        Returns
        -------
        dict with "F" (n, d), "UZ" (n, k), "rows" n, "n" (samples),
        "compute_s" and "parts"; or "dropout" (str) and "compute_s".
        """
        if batch_size < 1:
            raise ValueError(f"client {self.client_id}: batch_size must be >= 1, got {batch_size}")
        start = time.perf_counter()
        try:
            self._simulated_failure(position, round_index)
            with self._resident(), fastls.limit_cores(self.cores):
                upload, forward_s = self._rotated_rows(position, bool(coordinates))
            compute_s = time.perf_counter() - start
            self._check_deadline(position, compute_s)
        except ClientDropout as why:
            return {"dropout": str(why), "compute_s": time.perf_counter() - start}
        return {**upload, "rows": len(upload["F"]), "n": self.data.n_train, "compute_s": compute_s,
                "parts": {"forward_s": forward_s, "stats_s": compute_s - forward_s}}

    def _rotated_rows(self, position, coordinates):
        """({"F": U X, "UZ": U Z}, seconds of the forward pass) of layer ``position``'s rows."""
        layer_index = self.model.trainable[position]
        layer = self.model.layers[layer_index]
        input_shape = self.model.input_shape_of(layer_index)
        n_out = layer.ls_shape(input_shape)[1]
        if coordinates and self.bases[position] is None:
            raise ValueError(f"client {self.client_id}: layer {position + 1} has no label code narrower than its "
                             f"{n_out} outputs, so Y has no coordinates to upload; ask for Z")
        start = time.perf_counter()
        x = self._layer_inputs("train", layer_index)
        forward_s = time.perf_counter() - start
        X = layer.ls_rows(np.asarray(x))
        if coordinates:
            rows_per_sample = layer.rows_per_sample(input_shape)
            labels = np.repeat(self.data.y_train, rows_per_sample)
            codes = labels if self._position_shape(position) is None else \
                labels + np.tile(np.arange(rows_per_sample) * self.n_classes, self.data.n_train)
            Z = one_hot(codes, self.bases[position].shape[0], dtype=np.float64)
        else:
            Z = self._row_targets(position, self.data.y_train)
        if not self.options.rotate_rows:
            return {"F": X, "UZ": np.asarray(Z, dtype=self.stat_dtype)}, forward_s
        U = haar_orthogonal(len(X))
        F = np.empty(X.shape, dtype=X.dtype)
        # U X in float64 whatever X's dtype (F rounds once, to X's), a block of columns at a time.
        step = max(1, self.scratch_bytes // (8 * max(len(X), 1)))
        for first in range(0, X.shape[1], step):
            columns = slice(first, first + step)
            F[:, columns] = fastls.matmul(U, X[:, columns].astype(np.float64), check_finite=False)
        UZ = fastls.matmul(U, np.asarray(Z, dtype=np.float64), check_finite=False).astype(self.stat_dtype, copy=False)
        return {"F": F, "UZ": UZ}, forward_s

    def set_weights(self, position: int, weights: np.ndarray) -> dict:
        """Replace layer ``position`` by the (group's) trained weights."""
        layer_index = self.model.trainable[position]
        self.model.layers[layer_index].set_weights(_shared_cast(weights, self.model.dtype))
        self._weights_changed(layer_index)
        self.meta_weights[position] = weights
        return {}

    def personalize(self, position: int, eps: float | str, batch_size: int, private: bool = False,
                    keep_in: str | None = None, tag: str | None = None) -> dict:
        """Local personalization of one layer (eq. 13), through this client's own earlier layers.

        The proximal problem is solved in whichever form costs fewer flops
        (:func:`fastls.proximal_cost`): the primal from the streamed
        statistics, or the dual (Woodbury) from the layer's least-squares
        rows when the client has fewer rows than features.

        With ``eps="auto"`` the client picks eps for this layer from its own
        training split, moving no bytes: by exact leave-one-out when the
        layer has fewer than ``GCV_ROWS_PER_FEATURE`` rows per feature and they
        fit in ``scratch_bytes`` (one thin SVD of the rows, which then also
        gives the solution), else by GCV from the statistics (one
        eigendecomposition of G). The result records ``eps`` and the criterion.
        With ``eps="inf"`` (eq. 13's limit) the client keeps its group's layer.

        ``private``: return the busy time only (what the server learns of a
        client anyway); what was chosen (eps, criterion, primal or dual form)
        stays in :attr:`personal_choices`, written with the client's model
        (:meth:`save_personalized`).

        ``keep_in`` (a checkpointed run): the folder where this client keeps
        the layer, with the run's ``tag``, for :meth:`restore_personalized`
        (:func:`fedlayer.checkpoint.save_personal_layer`); written here, on
        the client's side, so that the weights never reach the server.
        """
        with self._resident():
            W, result = self._personalize(position, eps, batch_size)
            W = np.ascontiguousarray(W, dtype=self.model.dtype)
            choice = {key: result[key] for key in ("eps", "method", "form") if key in result}
            kept = None if keep_in is None else save_personal_layer(keep_in, self.client_id, position, W, tag,
                                                                    choice if private else None)
            self._install_personal(self.model.trainable[position], W, kept)
        if position == len(self.model.trainable) - 1:
            # The last layer's personalization was the training split's last pass: free its cache (at full width
            # the hundred clients' cached inputs of the classifier take 23 GB) before the models are written.
            self._drop("train")
        if private:
            self.personal_choices[position] = choice
            return {"compute_s": result["compute_s"]}
        return result

    def restore_personalized(self, positions: list[int], folder: str, tag: str) -> dict:
        """Install the layers at ``positions`` this client personalized before a checkpoint, from ``folder``.

        Each was written by :meth:`personalize` with ``keep_in=folder`` in a
        run of the same settings (``tag``); layers it did not personalize
        (it dropped out of that round) keep the group's weights.

        Raises
        ------
        ValueError
            If a layer's file is missing, damaged, or of another run.
        """
        with self._resident():
            for position in positions:
                W, choice = load_personal_layer(folder, self.client_id, position, tag)
                if choice is not None:
                    self.personal_choices[position] = choice
                self._install_personal(self.model.trainable[position], np.asarray(W, dtype=self.model.dtype),
                                       personal_layer_path(folder, self.client_id, position))
        return {}

    def _personalize(self, position, eps, batch_size):
        """(W, result record) of :meth:`personalize`, timed; the weights are not installed yet."""
        layer_index = self.model.trainable[position]
        layer = self.model.layers[layer_index]
        input_shape = self.model.input_shape_of(layer_index)
        n_in = layer.ls_shape(input_shape)[0]
        n_rows = self.data.n_train * layer.rows_per_sample(input_shape)
        basis = self.bases[position]
        costs = personalization_costs(layer, input_shape, self.data.n_train, basis)
        M = self.meta_weights[position].astype(self.stat_dtype, copy=False)
        start = time.perf_counter()
        if eps == "inf":  # eq. (13)'s limit: the group's layer, with no pass over the data
            return np.array(M), {"compute_s": time.perf_counter() - start, "form": "kept",
                                 "parts": {"forward_s": 0.0, "stats_s": 0.0, "solve_s": 0.0}}
        if eps == "auto":
            return self._personalize_auto(position, batch_size, M, n_rows, n_in, start)
        with fastls.limit_cores(self.cores):
            if costs["dual"] < costs["primal"]:
                x = self._layer_inputs("train", layer_index)
                forward_s = time.perf_counter() - start
                A = layer.ls_rows(np.asarray(x))
                Z = self._row_targets(position, self.data.y_train).astype(A.dtype, copy=False)
                stats_s = 0.0
                solve_start = time.perf_counter()
                W = fastls.proximal_solve_dual(A, Z, eps, M, rhs_basis=basis)
                form = "dual"
            else:
                G, C, forward_s, stats_s = self._statistics(position, int(batch_size), None)
                solve_start = time.perf_counter()
                W = fastls.proximal_solve(G, C, eps, M, overwrite_g=True, overwrite_c=True,
                                          rhs_basis=basis)
                form = "primal"
            solve_s = time.perf_counter() - solve_start
        return W, {"compute_s": time.perf_counter() - start, "form": form,
                   "parts": {"forward_s": forward_s, "stats_s": stats_s, "solve_s": solve_s}}

    def _personalize_auto(self, position, batch_size, M, n_rows, n_in, start):
        """:meth:`_personalize` with eps chosen on the client's own split (leave-one-out or GCV)."""
        layer_index = self.model.trainable[position]
        layer = self.model.layers[layer_index]
        input_shape = self.model.input_shape_of(layer_index)
        basis = self.bases[position]
        with fastls.limit_cores(self.cores):
            if n_rows < GCV_ROWS_PER_FEATURE * n_in and n_rows * n_in * 8 <= self.scratch_bytes:
                x = self._layer_inputs("train", layer_index)
                forward_s = time.perf_counter() - start
                stats_start = time.perf_counter()
                A = layer.ls_rows(np.asarray(x))
                rows_per_sample = layer.rows_per_sample(input_shape)
                labels = np.repeat(self.data.y_train, rows_per_sample)
                # With a basis the targets are passed as their one-hot coordinates in it (see target_bases).
                if basis is None:
                    Z = self._row_targets(position, self.data.y_train)
                else:
                    codes = labels if self._position_shape(position) is None else \
                        labels + np.tile(np.arange(rows_per_sample) * self.n_classes, self.data.n_train)
                    Z = one_hot(codes, basis.shape[0], dtype=np.float64)
                stats_s = time.perf_counter() - stats_start
                solve_start = time.perf_counter()
                path = fastls.RidgePath.from_rows(A, Z, center=M, rhs_basis=basis)
                # The class decision needs one code per class: not for a convolution coded per position.
                criterion = self.eps_criterion if self._position_shape(position) is None else "loo"
            else:
                G, C, forward_s, stats_s = self._statistics(position, int(batch_size), None)
                zz, rows = self._target_moments(position)
                solve_start = time.perf_counter()
                path = fastls.RidgePath.from_statistics(G, C, zz, rows, center=M, rhs_basis=basis, overwrite_g=True)
                del G, C
                criterion, labels = "gcv", None
            eps, _, _ = path.select(criterion, labels=labels)
            W = path.solve(eps)
            solve_s = time.perf_counter() - solve_start
        return W, {"compute_s": time.perf_counter() - start, "method": criterion, "eps": eps,
                   "parts": {"forward_s": forward_s, "stats_s": stats_s, "solve_s": solve_s}}

    def evaluate(self, batch_size: int = 4096, code_layer: int | None = None) -> dict:
        """(correct, total) of this client's current model on its local test split, in batches.

        Parameters
        ----------
        batch_size : int, default=4096
        code_layer : int or None, default=None
            Position of a trained hidden layer (one with a label code): each
            test sample is then given the class whose least-squares target at
            that layer (Z = Y Q_l, per output position for a convolution coded
            per position) is nearest the layer's output, argmax_c 2 <z, t_c> -
            ||t_c||^2, instead of the network's prediction (batches as the
            test split's cache moves, not ``batch_size``). With the test split
            cached at the layer's input, as it is when every round is scored,
            it costs that layer's forward pass alone.
        """
        # Cache through the layers that hold this stage's weights; the rest
        # (not trained yet, or about to be replaced) run uncached.
        with self._resident():
            if code_layer is None:
                return self._evaluate(batch_size)
            return self._evaluate_codes(int(code_layer))

    def _evaluate_codes(self, position):
        if not 0 <= position < len(self.encoders):
            raise ValueError(f"code_layer must be the position of a hidden layer with a label code, 0 to "
                             f"{len(self.encoders) - 1}; got {position}")
        index = self.model.trainable[position]
        y = self.data.y_test
        codes = self._targets(position, np.arange(self.n_classes))  # (classes, m) or (classes, out_h, out_w, m)
        flat = codes.reshape(self.n_classes, -1)
        squared_norms = np.einsum("ck,ck->c", flat, flat)
        correct = 0

        def score(s, z):
            nonlocal correct
            positions = 1
            if z.ndim > codes.ndim:  # a convolution coded per image: every output position aims at the same code
                positions = math.prod(z.shape[1:-1])
                z = z.reshape(len(z), positions, -1).sum(axis=1)
            scores = 2.0 * fastls.matmul(z.reshape(len(z), -1), flat.T, check_finite=False)
            scores -= positions * squared_norms
            correct += int(np.count_nonzero(scores.argmax(axis=1) == y[s:s + len(z)]))

        # The readout rides on moving the test split's cache through the layer, as the network's evaluation
        # would have: the layer's forward pass is computed once, and the next round starts after it.
        if self._activations.get("test", (0, None))[0] > index:
            self._drop("test")  # cached past the layer (scored before): the tap needs the pass through it
        self._layer_inputs("test", index)
        self._layer_inputs("test", self._next_trainable(index), tap=(index, score))
        return {"correct": correct, "total": len(y)}

    def _evaluate(self, batch_size):
        start_layer = self._evaluated_upto
        x = self._layer_inputs("test", start_layer)
        step = min(batch_size, self._forward_rows(start_layer, len(self.model.layers)))
        correct, total = self.model.accuracy(x, self.data.y_test, batch_size=step, start=start_layer)
        return {"correct": correct, "total": total}

    def final_weights(self) -> dict:
        """Weights of every trainable layer (for checks in this process; a run never sends them anywhere)."""
        with self._resident():
            return {"weights": [self.model.layers[i].weights for i in self.model.trainable]}

    def save_personalized(self, path: str | os.PathLike, metadata: dict) -> dict:
        """Write this client's personalized model to ``path`` here, on the client's side of the transport.

        Personalization moves no bytes: the weights never go to the server
        (under ``mpiexec``, the rank hosting this client writes the file).
        ``metadata`` (JSON-able) is stored with the model, with what this
        client chose per layer if it personalized privately. Returns the
        bytes written only.
        """
        with self._resident():
            if self.personal_choices:
                choices = {str(p): c for p, c in sorted(self.personal_choices.items())}
                metadata = {**metadata, "personalization": choices}
            self.model.save(path, metadata=metadata)
        return {"bytes": os.path.getsize(path)}
