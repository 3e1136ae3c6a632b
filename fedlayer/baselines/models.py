"""The baselines' networks: LR and the [128, 64] DNN with hand-written backpropagation.

Parameters are one flat float64 vector; the model knows the shapes and hands
out views (:meth:`BaselineModel.unpack`), so perturbations and averaging are
plain vector arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

import fastls

__all__ = ["MODEL_HIDDEN", "BaselineModel", "make_baseline_model"]

#: Hidden widths of the baselines' models (the paper's LR and DNN).
MODEL_HIDDEN = {"lr": (), "dnn": (128, 64)}


class BaselineModel:
    """Fully connected softmax classifier with hand-written backpropagation.

    Layers ``n_features -> hidden... -> n_classes``; ReLU after every hidden
    layer; softmax + cross-entropy (mean over the batch) at the output.
    Parameters: one flat float64 vector, layer by layer ``W_l`` (n_in, n_out,
    row-major) then ``b_l`` (n_out,).
    """

    name: str
    n_features: int
    n_classes: int
    layer_sizes: tuple[int, ...]
    shapes: list[tuple[int, ...]]
    sizes: list[int]
    offsets: npt.NDArray[np.int_]
    n_params: int

    def __init__(self, name: str, n_features: int, n_classes: int, hidden: Sequence[int] = ()) -> None:
        self.name = name
        self.n_features = int(n_features)
        self.n_classes = int(n_classes)
        sizes = [self.n_features, *map(int, hidden), self.n_classes]
        self.layer_sizes = tuple(sizes)
        self.shapes = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            self.shapes += [(n_in, n_out), (n_out,)]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(int)
        self.n_params = int(self.offsets[-1])

    def __repr__(self) -> str:
        return f"BaselineModel({self.name!r}, layers={self.layer_sizes}, n_params={self.n_params})"

    # -- parameters ----------------------------------------------------------
    def unpack(self, params: npt.ArrayLike) -> list[npt.NDArray[np.floating]]:
        """Views ``[W_1, b_1, W_2, b_2, ...]`` into ``params``.

        ``params`` is one flat vector (n_params,) or a stack of them (..., n_params);
        the views then carry the same leading axes, e.g. W_1 of shape (..., n_in, n_out).
        """
        params = np.asarray(params)
        if params.ndim < 1 or params.shape[-1] != self.n_params:
            raise ValueError(f"expected flat vectors of {self.n_params} parameters (shape (..., {self.n_params})), "
                             f"got shape {params.shape}")
        lead = params.shape[:-1]
        return [params[..., a:b].reshape(lead + s) for a, b, s in zip(self.offsets[:-1], self.offsets[1:], self.shapes)]

    def init_params(self, seed: int) -> npt.NDArray[np.float64]:
        """PyTorch-default-like init: W and b ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)), seeded; (n_params,) float64."""
        rng = np.random.default_rng([int(seed), 0xBA5E])
        params = np.empty(self.n_params)
        views = self.unpack(params)
        for k in range(len(views) // 2):
            W, b = views[2 * k], views[2 * k + 1]
            bound = 1.0 / np.sqrt(W.shape[0])  # fan_in
            W[...] = rng.uniform(-bound, bound, size=W.shape)
            b[...] = rng.uniform(-bound, bound, size=b.shape)
        return params

    # -- forward / backward --------------------------------------------------
    def _input(self, x):
        x = np.asarray(x)
        return x.reshape(x.shape[0], -1).astype(np.float64, copy=False)

    @staticmethod
    def _matmul(a, b):
        if a.ndim == 2 and b.ndim == 2:
            # fastls.matmul: the size rule picks the BLAS threads, as for the analytic clients.
            return fastls.matmul(a, b, check_finite=False)
        # Stacked (the batched engine): NumPy runs one gemm per pair of 2-D slices.
        return np.matmul(a, b)

    def _forward(self, params, x):
        """Activations of every layer: ``params`` (..., P) with ``x`` (..., B, n_features), or (P,) with (B, ...)."""
        views = self.unpack(params)
        acts = [self._input(x) if np.ndim(params) == 1 else np.asarray(x, dtype=np.float64)]
        n_layers = len(views) // 2
        for k in range(n_layers):
            b = views[2 * k + 1]
            z = self._matmul(acts[-1], views[2 * k]) + (b if b.ndim == 1 else b[..., None, :])
            if k < n_layers - 1:
                z = np.maximum(z, 0.0)
            acts.append(z)
        return acts  # acts[-1] are the logits

    @staticmethod
    def _log_softmax(logits):
        shifted = logits - logits.max(axis=-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))

    def logits(self, params: npt.NDArray[np.float64], x: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """The output layer's scores (B, n_classes) of the samples x (B, ...) at params (n_params,)."""
        return self._forward(params, x)[-1]

    def loss(self, params: npt.NDArray[np.float64], x: npt.ArrayLike, y: npt.ArrayLike) -> float:
        """Mean cross-entropy of the softmax outputs at ``params`` (n_params,) on samples x (B, ...), labels y (B,)."""
        return float(self._mean_nll(self._log_softmax(self.logits(params, x)), np.asarray(y)))

    def loss_and_grad(self, params: npt.NDArray[np.float64], x: npt.ArrayLike,
                      y: npt.ArrayLike) -> tuple[float, npt.NDArray[np.float64]]:
        """(loss, flat gradient (n_params,) float64) of :meth:`loss`, by exact backpropagation."""
        y = np.asarray(y)
        acts = self._forward(params, x)
        logp = self._log_softmax(acts[-1])
        return float(self._mean_nll(logp, y)), self._backward(params, acts, self._output_error(logp, y))

    @staticmethod
    def _mean_nll(logp, y):
        """Mean cross-entropy over the rows (axis -2) of ``logp`` (..., m, classes), log-probabilities; y (..., m)."""
        index = np.broadcast_to(y[..., None], logp.shape[:-1] + (1,))
        return -np.take_along_axis(logp, index, axis=-1)[..., 0].mean(axis=-1)

    @staticmethod
    def _output_error(logp, y):
        """d(mean cross-entropy)/d(logits) = (softmax - one-hot) / m, for ``logp`` (..., m, classes)."""
        delta = np.exp(logp)
        index = y[..., None]
        np.put_along_axis(delta, index, np.take_along_axis(delta, index, axis=-1) - 1.0, axis=-1)
        delta /= logp.shape[-2]
        return delta

    def _backward(self, params, acts, delta, out=None):
        """Flat gradient(s) from the activations and the output error ``delta`` (dLoss/dlogits), into ``out``."""
        views = self.unpack(params)
        grad = np.empty(np.shape(params)) if out is None else out
        gviews = self.unpack(grad)
        for k in range(len(views) // 2 - 1, -1, -1):
            if delta.ndim == 2:
                fastls.matmul(acts[k].T, delta, out=gviews[2 * k], check_finite=False)
            else:
                np.matmul(acts[k].swapaxes(-1, -2), delta, out=gviews[2 * k])
            np.sum(delta, axis=-2, out=gviews[2 * k + 1])
            if k > 0:
                delta = self._matmul(delta, views[2 * k].swapaxes(-1, -2)) * (acts[k] > 0)
        return grad

    def grad(self, params: npt.NDArray[np.float64], x: npt.ArrayLike, y: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Flat gradient (n_params,) float64 of :meth:`loss` (exact backpropagation)."""
        return self.loss_and_grad(params, x, y)[1]

    # -- stacked clients (the batched engine) --------------------------------
    def directional_losses(
        self, W: npt.NDArray[np.float64], x: npt.NDArray[np.float64], y: npt.NDArray[np.integer],
    ) -> tuple[npt.NDArray[np.float64],
               Callable[[npt.NDArray[np.float64], npt.NDArray[np.float64]], npt.NDArray[np.float64]]]:
        """Each client's loss at its parameters, and its losses along directions from there.

        Parameters
        ----------
        W : ndarray (C, P) float64
            One parameter vector per client.
        x : ndarray (C, m, n_features) float64
            Each client's minibatch (m rows for all).
        y : ndarray (C, m) int

        Returns
        -------
        f0 : ndarray (C,)
        losses : callable(U (C, J, P), scales (C, J)) -> ndarray (C, J)
            The losses at ``W[c] + scales[c, j] U[c, j]``. The first layer is
            evaluated as ``x W_1 + s (x U_1)``, a product on the draws
            themselves (the widest matrix is never copied perturbed), the
            others with perturbed weights. Each client's numbers depend on its
            own slices only, not on how many clients share the stack.
        """
        views = self.unpack(W)
        n_layers = len(views) // 2
        base = np.matmul(x, views[0])  # x W_1, shared by every direction
        z = base + views[1][:, None, :]
        for k in range(1, n_layers):
            z = np.matmul(np.maximum(z, 0.0), views[2 * k]) + views[2 * k + 1][:, None, :]
        f0 = self._mean_nll(self._log_softmax(z), y)

        def losses(U, scales):
            # In place where the operands allow: the same operations as the plain expressions, bit for bit
            # (a product and a sum commute exactly), without a fresh (C, J, m, width) array for each.
            directions = self.unpack(U)
            s = scales[..., None, None]
            z = np.matmul(x[:, None], directions[0])
            z *= s
            z += base[:, None]
            z += (views[1][:, None] + scales[..., None] * directions[1])[..., None, :]
            for k in range(1, n_layers):
                weights = views[2 * k][:, None] + s * directions[2 * k]
                bias = views[2 * k + 1][:, None] + scales[..., None] * directions[2 * k + 1]
                z = np.matmul(np.maximum(z, 0.0, out=z), weights)
                z += bias[..., None, :]
            return self._mean_nll(self._log_softmax(z), y[:, None])

        return f0, losses

    def stacked_grad(self, params: npt.NDArray[np.float64], x: npt.NDArray[np.float64], y: npt.NDArray[np.integer],
                     out: npt.NDArray[np.float64] | None = None) -> npt.NDArray[np.float64]:
        """Gradients (C, P) of each client's mean loss at params (C, P) on its batch x (C, m, n_features), y (C, m).

        ``out`` (C, P) float64 receives them when given (a reused buffer
        spares the page faults of a fresh one at every step).
        """
        acts = self._forward(params, x)
        return self._backward(params, acts, self._output_error(self._log_softmax(acts[-1]), y), out)

    def predict(self, params: npt.NDArray[np.float64], x: npt.ArrayLike, chunk: int = 8192) -> npt.NDArray[np.int64]:
        """Predicted labels (B,) of the samples x (B, ...), evaluated in chunks of ``chunk`` samples."""
        n = len(x)
        out = np.empty(n, dtype=np.int64)
        for start in range(0, n, chunk):
            out[start:start + chunk] = self.logits(params, x[start:start + chunk]).argmax(axis=1)
        return out


def make_baseline_model(name: str, n_features: int | Sequence[int], n_classes: int,
                        seed: int | None = None) -> BaselineModel | tuple[BaselineModel, npt.NDArray[np.float64]]:
    """``"lr"`` or ``"dnn"`` model; with ``seed``, returns ``(model, initial params)``.

    ``n_features`` may be an int or a feature shape (it is flattened). The
    initial parameters are :meth:`BaselineModel.init_params` of ``seed``.

    Raises
    ------
    ValueError
        ``name`` is not a key of :data:`MODEL_HIDDEN`.
    """
    key = str(name).lower()
    if key not in MODEL_HIDDEN:
        raise ValueError(f"unknown baseline model {name!r}; choose one of {sorted(MODEL_HIDDEN)}")
    n_in = int(np.prod(n_features))
    model = BaselineModel(key, n_in, n_classes, MODEL_HIDDEN[key])
    if seed is None:
        return model
    return model, model.init_params(seed)
