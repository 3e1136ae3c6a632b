"""Layer-wise models for analytic (least-squares) training, in plain NumPy.

ACnnL trains a network one layer at a time: layer ``l`` gets the closed-form
ridge solution ``W_l = (X_l^T X_l + gamma I)^-1 X_l^T Z_l`` of its input
``X_l`` (the output of the layers below) and a target ``Z_l`` (an encoded
label). In the federated versions each client only contributes the sufficient
statistics ``G = X_l^T X_l`` and ``C = X_l^T Z_l``. A :class:`TrainableLayer`
therefore exposes exactly what that needs:

* :meth:`TrainableLayer.ls_shape`: the shapes of its ``G`` and ``C``;
* :meth:`TrainableLayer.accumulate`: add a batch to ``G`` and ``C`` (streamed,
  through the compiled :mod:`fastls` kernels);
* :meth:`TrainableLayer.set_weights`: install a solution.

The bias is the last row of the weight matrix and is learned by appending a
constant-1 column to the layer input, so it is regularized like every other
weight (plain ridge on ``[X, 1]``).

Shapes and layouts
------------------
* Per-sample shapes never include the batch dimension; batches are
  ``(B, *shape)``.
* Images are NHWC (channels last), the layout of :mod:`fastls` and
  :mod:`fedlayer.data`.
* A :class:`Dense` weight matrix is ``(d_in + bias, units)``; a
  :class:`Conv2d` weight matrix is ``(kh * kw * channels + bias, filters)``
  with rows ordered ``(ky, kx, channel)``, the column order of
  :func:`fastls.im2col`.

Examples
--------
>>> import numpy as np, fastls
>>> model = build_model("lr", (60,), 10)
>>> i = model.trainable[0]
>>> layer = model.layers[i]
>>> n_in, n_out = layer.ls_shape(model.input_shape_of(i))
>>> G, C = np.zeros((n_in, n_in)), np.zeros((n_in, n_out))
>>> x, z = np.ones((5, 60)), np.ones((5, 10))
>>> layer.accumulate(G, C, x, z)
>>> layer.set_weights(fastls.ridge_solve(G, C, 1.0))
>>> model.predict(x).shape
(5,)
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
import tempfile
import weakref
import zipfile
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

import fastls

from ._validation import Interval, ListOf, check_param

__all__ = [
    "Activation",
    "Identity",
    "ReLU",
    "LeakyReLU",
    "ACTIVATIONS",
    "get_activation",
    "Layer",
    "Flatten",
    "AvgPool2d",
    "TrainableLayer",
    "Dense",
    "Conv2d",
    "Model",
    "LAYER_TYPES",
    "DCNN_PADDINGS",
    "KNOWN_MODELS",
    "check_padding",
    "build_model",
    "model_from_layers",
]

#: Default bound on the working memory of the streamed kernels (bytes): fastls's.
DEFAULT_SCRATCH_BYTES = fastls.tuning.DEFAULT_SCRATCH_BYTES

#: Rows per chunk when a Dense layer builds ``[x, 1]``; the fastls float32
#: block size, so a chunk is one BLAS call on the mixed-precision path too.
_DENSE_CHUNK_ROWS = 4096

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

#: File format tag written by :meth:`Model.save`.
_FORMAT = "fedlayer.models/1"


# ---------------------------------------------------------------------------
# Small validators
# ---------------------------------------------------------------------------

def _positive_int(name, value):
    check_param(name, value, [Interval(int, 1, None)])
    return int(value)


def _int_pair(name, value, minimum):
    item = Interval(int, minimum, None)
    if item.is_satisfied_by(value):
        return int(value), int(value)
    check_param(name, value, [item, ListOf(item, min_length=2)])
    if len(value) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints >= {minimum}, got {value!r}")
    return int(value[0]), int(value[1])


def _pair_config(pair):
    """An int when square (the common case reads better), else a list."""
    return pair[0] if pair[0] == pair[1] else list(pair)


def _as_shape(name, shape):
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"{name} must be a tuple of positive ints, got {shape!r}") from None
    if not shape or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1 for s in shape):
        raise ValueError(f"{name} must be a non-empty tuple of positive ints, got {shape!r}")
    return tuple(int(s) for s in shape)


def _float_dtype(dtype):
    dtype = np.dtype(dtype)
    if dtype not in _FLOATS:
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    return dtype


def _as_float(x, dtype=None):
    """x as a float32/float64 array: ``dtype`` when given, else x's own float
    dtype (other dtypes, e.g. uint8 pixels, become float64)."""
    x = np.asarray(x)
    if dtype is not None:
        return x.astype(dtype, copy=False)
    if x.dtype in _FLOATS:
        return x
    return x.astype(np.float64)


def _check_batch(layer, x, ndim, what):
    if x.ndim != ndim:
        raise ValueError(f"{layer!r} expects a batch of shape {what}, got shape {x.shape}")


# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------

class Activation:
    """Element-wise activation function.

    Subclasses set ``name`` and implement ``__call__``. They may also override
    :meth:`apply_inplace`, which layers call on their freshly computed
    pre-activations to avoid a second output-sized array (the DCNN's first
    layer produces 512 channels per pixel).

    Only the built-in activations of :data:`ACTIVATIONS` survive
    :meth:`Model.save` / :meth:`Model.load`.
    """

    name: str = ""

    def __call__(self, x: npt.ArrayLike) -> npt.ArrayLike:
        """f(x), element-wise; x is not modified.

        Parameters
        ----------
        x : array_like of any shape

        Returns
        -------
        ndarray of the shape of x
            A new array, or x itself when f leaves it unchanged (identity).
        """
        raise NotImplementedError

    def apply_inplace(self, x: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        """f(x), allowed to overwrite x.

        Parameters
        ----------
        x : ndarray of any shape, float32 or float64
            An array the caller owns and no longer needs.

        Returns
        -------
        ndarray of the shape and dtype of x
            x itself when overwritten, else a new array.
        """
        return self(x)

    def config(self) -> str | dict[str, Any]:
        """JSON-able spec accepted by :func:`get_activation`: the name, or a dict of the name and parameters."""
        return self.name

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.config(), sort_keys=True))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(Activation):
    """f(x) = x (output layers and linear models)."""

    name = "identity"

    def __call__(self, x: npt.ArrayLike) -> npt.ArrayLike:
        return x

    apply_inplace = __call__


class ReLU(Activation):
    """f(x) = max(x, 0)."""

    name = "relu"

    def __call__(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        return np.maximum(_as_float(x), 0)

    def apply_inplace(self, x: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        return np.maximum(x, 0, out=x)


class LeakyReLU(Activation):
    """f(x) = x for x >= 0, negative_slope * x for x < 0 (PyTorch's LeakyReLU).

    Parameters
    ----------
    negative_slope : float, default=0.01
        Any finite real; the default is PyTorch's.
    """

    name = "leaky_relu"
    negative_slope: float

    def __init__(self, negative_slope: float = 0.01) -> None:
        if isinstance(negative_slope, bool) or not isinstance(negative_slope, numbers.Real) \
                or not math.isfinite(negative_slope):
            raise ValueError(f"negative_slope must be a finite number, got {negative_slope!r}")
        self.negative_slope = float(negative_slope)

    def __call__(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        return self.apply_inplace(np.array(_as_float(x), copy=True))

    def apply_inplace(self, x: npt.NDArray[np.floating]) -> npt.NDArray[np.floating]:
        # Scaling only the negative entries is right for any slope (max(x, s x)
        # is only right for s <= 1); fastls does it in one vectorized pass, far
        # cheaper than NumPy's masked multiply (docs/results/fedlayer_notes.md).
        if x.flags.writeable and (x.flags.c_contiguous or x.flags.f_contiguous):
            return fastls.scale_negatives(x, self.negative_slope)
        np.multiply(x, x.dtype.type(self.negative_slope), out=x, where=x < 0)
        return x

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "negative_slope": self.negative_slope}

    def __repr__(self) -> str:
        return f"LeakyReLU(negative_slope={self.negative_slope!r})"


#: Built-in activations by name.
ACTIVATIONS = {"identity": Identity, "relu": ReLU, "leaky_relu": LeakyReLU}


def get_activation(spec: str | Mapping[str, Any] | Activation | None) -> Activation:
    """Activation from a name, a config dict, None or an Activation.

    Parameters
    ----------
    spec : str, dict, None or Activation
        ``"identity"`` / None, ``"relu"``, ``"leaky_relu"`` (case-insensitive);
        a dict ``{"name": ..., **params}`` such as
        ``{"name": "leaky_relu", "negative_slope": 0.1}`` (what
        :meth:`Activation.config` returns); or an instance, returned as is.

    Returns
    -------
    Activation

    Raises
    ------
    ValueError
        Unknown name or parameters; the message lists the known names.
    """
    known = ", ".join(repr(n) for n in ACTIVATIONS)
    if spec is None:
        return Identity()
    if isinstance(spec, Activation):
        return spec
    if isinstance(spec, Mapping):
        params = dict(spec)
        name = params.pop("name", None)
    else:
        name, params = spec, {}
    if not isinstance(name, str) or name.lower() not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known activations: {known}, or an Activation instance")
    cls = ACTIVATIONS[name.lower()]
    try:
        return cls(**params)
    except TypeError:
        raise ValueError(f"invalid parameters {sorted(params)} for activation {name!r}") from None


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------

class Layer:
    """Base layer: a fixed map of per-sample arrays with no weights.

    Subclasses define ``type_name`` (the ``"type"`` of :meth:`config`),
    ``_PARAMS`` (constructor keys accepted by :func:`model_from_layers`) and
    ``_REQUIRED``.
    """

    type_name: str = "layer"
    _PARAMS: tuple[str, ...] = ()
    _REQUIRED: tuple[str, ...] = ()

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        """Per-sample output shape for a per-sample input shape (no batch dim).

        Parameters
        ----------
        input_shape : sequence of int
            Per-sample input shape, e.g. (d,) or (H, W, C).

        Returns
        -------
        tuple of int

        Raises
        ------
        ValueError
            The layer cannot take that input (wrong rank, a window larger than the image).
        """
        raise NotImplementedError

    def forward(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        """Apply the layer to a batch.

        Parameters
        ----------
        x : array_like of shape (B, *input_shape)

        Returns
        -------
        ndarray of shape (B, *output_shape(input_shape))
        """
        raise NotImplementedError

    def _params(self):
        return {}

    def config(self) -> dict[str, Any]:
        """JSON-able ``{"type": ..., **constructor params}``."""
        return {"type": self.type_name, **self._params()}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._params().items())
        return f"{type(self).__name__}({args})"


class Flatten(Layer):
    """(B, *shape) -> (B, prod(shape)), C order (for NHWC: (y, x, channel))."""

    type_name = "flatten"

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        input_shape = _as_shape("input_shape", input_shape)
        return (math.prod(input_shape),)

    def forward(self, x: npt.ArrayLike) -> npt.NDArray[Any]:
        """
        Parameters
        ----------
        x : ndarray of shape (B, *shape)

        Returns
        -------
        ndarray of shape (B, prod(shape))
            A view of x when x is C-contiguous; dtype of x.
        """
        x = np.asarray(x)
        if x.ndim < 2:
            raise ValueError(f"Flatten expects a batch of shape (B, ...), got shape {x.shape}")
        return x.reshape(x.shape[0], math.prod(x.shape[1:]))  # not -1: an empty batch has no size to infer from


class AvgPool2d(Layer):
    """Average pooling over NHWC images without padding.

    The output size is ``floor((H - pool) / stride) + 1`` (PyTorch's
    ``AvgPool2d`` with ``ceil_mode=False``): trailing rows/columns that do
    not fill a window are dropped.

    Parameters
    ----------
    pool_size : int or (int, int), default=2
    stride : int or (int, int), optional
        Defaults to ``pool_size`` (non-overlapping windows).
    """

    type_name = "avgpool2d"
    _PARAMS = ("pool_size", "stride")
    pool_size: tuple[int, int]
    stride: tuple[int, int]

    def __init__(self, pool_size: int | Sequence[int] = 2, stride: int | Sequence[int] | None = None) -> None:
        self.pool_size = _int_pair("pool_size", pool_size, 1)
        self.stride = self.pool_size if stride is None else _int_pair("stride", stride, 1)

    def _params(self):
        return {"pool_size": _pair_config(self.pool_size), "stride": _pair_config(self.stride)}

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        input_shape = _as_shape("input_shape", input_shape)
        if len(input_shape) != 3:
            raise ValueError(f"AvgPool2d expects images (H, W, C), got per-sample shape {input_shape}")
        H, W, C = input_shape
        (ph, pw), (sh, sw) = self.pool_size, self.stride
        if H < ph or W < pw:
            raise ValueError(f"a {ph}x{pw} pooling window does not fit a {H}x{W} image")
        return ((H - ph) // sh + 1, (W - pw) // sw + 1, C)

    def forward(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        """
        Parameters
        ----------
        x : ndarray of shape (B, H, W, C)
            float32/float64 kept, other dtypes become float64.

        Returns
        -------
        ndarray of shape (B, out_h, out_w, C), dtype of x
        """
        x = _as_float(x)
        _check_batch(self, x, 4, "(B, H, W, C)")
        return fastls.avg_pool2d(x, self.pool_size, self.stride)


class TrainableLayer(Layer):
    """A linear map followed by an activation, trained by least squares.

    Attributes
    ----------
    activation : Activation
    bias : bool
        When True the weight matrix has one extra last row, the bias, fitted
        through a constant-1 input column (regularized like the weights).
    weights : ndarray of shape (n_inputs, n_outputs) or None
        C-contiguous, in :attr:`dtype`; None until trained or set.
    dtype : numpy.dtype
        Weight dtype (the model's; float64 for a standalone layer).
    input_shape : tuple or None
        Per-sample input shape, known once the layer belongs to a Model.
    """

    activation: Activation
    bias: bool
    weights: npt.NDArray[np.floating] | None
    dtype: np.dtype
    input_shape: tuple[int, ...] | None

    def __init__(self, activation: str | Mapping[str, Any] | Activation | None = "identity", bias: bool = True) -> None:
        try:
            self.activation = get_activation(activation)
        except ValueError as exc:
            raise ValueError(f"activation: {exc}") from None
        if not isinstance(bias, (bool, np.bool_)):
            raise ValueError(f"bias must be True or False, got {bias!r}")
        self.bias = bool(bias)
        self.weights = None
        self.dtype = np.dtype(np.float64)
        self.input_shape = None

    # -- shapes ----------------------------------------------------------

    @property
    def n_outputs(self) -> int:
        """Columns of the weight matrix: the layer's output features or channels."""
        raise NotImplementedError

    def _n_inputs(self, input_shape):
        raise NotImplementedError

    def ls_shape(self, input_shape: Sequence[int]) -> tuple[int, int]:
        """(n_inputs, n_outputs) of the least-squares problem of this layer.

        ``G`` is (n_inputs, n_inputs) and ``C`` (n_inputs, n_outputs);
        n_inputs counts the bias row.

        Parameters
        ----------
        input_shape : sequence of int
            Per-sample input shape.

        Returns
        -------
        (int, int)

        Raises
        ------
        ValueError
            The layer cannot take that input.
        """
        self.output_shape(input_shape)  # validates
        return self._n_inputs(_as_shape("input_shape", input_shape)), self.n_outputs

    def _bind(self, input_shape, dtype):
        """Called by Model: fix the input shape and dtype, check any weights."""
        self.input_shape = tuple(input_shape)
        self.dtype = np.dtype(dtype)
        if self.weights is not None:
            self.set_weights(self.weights)

    # -- weights ---------------------------------------------------------

    def _check_weight_rows(self, n_rows):
        """Row count check when the input shape is not known yet."""
        if n_rows < 1 + self.bias:
            raise ValueError(f"{self!r} needs at least {1 + self.bias} weight rows, got {n_rows}")

    def set_weights(self, W: npt.ArrayLike) -> None:
        """Install W (copied, C-contiguous, in :attr:`dtype`; a read-only one is shared).

        Parameters
        ----------
        W : array_like of shape (n_inputs, n_outputs)
            Real numbers; the bias is the last row when ``bias`` is True.
            n_inputs is checked against :attr:`input_shape` when known. A
            read-only C-contiguous array of the layer's dtype is installed
            as it is, not copied: nobody can change it, and simulated clients
            in one process then hold one copy of the weights they share.

        Raises
        ------
        TypeError
            W does not hold real numbers.
        ValueError
            W's shape is not (n_inputs, n_outputs) of this layer.
        """
        W = np.asarray(W)
        if not (np.issubdtype(W.dtype, np.floating) or np.issubdtype(W.dtype, np.integer)):
            raise TypeError(f"weights must be real numbers, got dtype {W.dtype}")
        if W.ndim != 2 or W.shape[1] != self.n_outputs:
            raise ValueError(f"{self!r} expects weights of shape (n_inputs, {self.n_outputs}), got {W.shape}")
        if self.input_shape is not None:
            expected = self.ls_shape(self.input_shape)
            if W.shape != expected:
                raise ValueError(
                    f"{self!r} on input {self.input_shape} expects weights of shape {expected}, got {W.shape}"
                )
        else:
            self._check_weight_rows(W.shape[0])
        if W.dtype == self.dtype and W.flags.c_contiguous and not W.flags.writeable:
            self.weights = W
            return
        # A copy, so a caller reusing its solver output cannot change the model.
        self.weights = np.array(W, dtype=self.dtype, order="C", copy=True)

    def _require_weights(self):
        if self.weights is None:
            raise RuntimeError(f"{self!r} has no weights yet: train it or call set_weights")
        return self.weights

    # -- least squares ---------------------------------------------------

    def _check_stats(self, G, C, n_inputs, width=None):
        width = self.n_outputs if width is None else width
        for name, A, shape in (("G", G, (n_inputs, n_inputs)), ("C", C, (n_inputs, width))):
            if not isinstance(A, np.ndarray):
                raise TypeError(f"{name} must be a NumPy array, got {type(A).__name__}")
            if A.shape != shape:
                raise ValueError(
                    f"{self!r} with {n_inputs} least-squares inputs (bias included) needs {name} of shape "
                    f"{shape}, got {A.shape}"
                )

    def _ls_input(self, x, ndim, what):
        x = np.asarray(x)
        # float32 stays float32 (fastls accumulates it into a float64 G);
        # anything else (e.g. uint8 pixels) is taken in the model dtype.
        if x.dtype not in _FLOATS:
            x = x.astype(self.dtype)
        _check_batch(self, x, ndim, what)
        if self.input_shape is not None and x.shape[1:] != self.input_shape:
            raise ValueError(
                f"{self!r} expects input of shape (B, {', '.join(map(str, self.input_shape))}), got {x.shape}"
            )
        return x

    def _ls_target(self, z, B, dtype, allowed_shapes):
        z = np.asarray(z)
        if z.shape not in allowed_shapes:
            raise ValueError(
                f"{self!r}: targets z must have shape {' or '.join(map(str, allowed_shapes))} "
                f"for a batch of {B}, got {z.shape}"
            )
        # fastls wants targets in the input dtype; z is B x m, cheap to cast.
        return np.ascontiguousarray(z, dtype=dtype)

    def accumulate(self, G: npt.NDArray[np.floating], C: npt.NDArray[np.floating], x: npt.ArrayLike,
                   z: npt.ArrayLike, *, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        """G += A^T A (upper triangle) and C += A^T z for this layer's LS input A.

        See the subclasses for A. G and C must be writable, C- or
        F-contiguous float arrays of shapes :meth:`ls_shape`; float32 x with
        float64 G and C is allowed (accumulated in float64). One batch of
        :meth:`statistics`.

        Parameters
        ----------
        G : ndarray of shape (n_inputs, n_inputs), float32 or float64
        C : ndarray of shape (n_inputs, n_outputs), dtype of G
        x : array_like of shape (B, *input_shape)
        z : array_like of shape (B, n_outputs)
            Targets (Conv2d also takes one per output position).
        scratch_bytes : int, default=64 MiB
            Bound on the kernels' working memory.
        """
        with self.statistics(G, C, scratch_bytes=scratch_bytes) as stats:
            stats.update(x, z)

    def statistics(self, G: npt.NDArray[np.floating], C: npt.NDArray[np.floating], *,
                   scratch_bytes: int = DEFAULT_SCRATCH_BYTES, samples: int | None = None,
                   position_basis: npt.NDArray[np.floating] | None = None,
                   target_width: int | None = None) -> _LayerStatistics:
        """A running accumulator of G and C over batches: ``update(x, z)``, then ``finish()``.

        Use it as a context manager; G and C are complete when it closes.
        Batches are checked as in :meth:`accumulate`.

        Parameters
        ----------
        G, C : ndarray
            As in :meth:`accumulate` (C has ``target_width`` or the basis' m
            columns when one of them is given).
        scratch_bytes : int, default=64 MiB
            Bound on the kernels' working memory.
        samples : int, optional
            The total the batches will hold when known: lets the kernels pick
            their method for the whole pass.
        position_basis : ndarray of shape (out_h, out_w, k, m), optional
            Conv2d only: ``z`` holds (B, k) coordinates, the target at output
            position (y, x) is ``z @ position_basis[y, x]`` and C has its m
            columns (:class:`fastls.ConvStats`).
        target_width : int, optional
            z (B, w) and C (n_inputs, w) have w columns instead of the layer's
            outputs, e.g. the coordinates Y of targets Y Q, for X^T Y instead
            of X^T Y Q (a convolution repeats a sample's row of z at each
            output position).

        Returns
        -------
        accumulator
            With ``update(x, z)`` (returns itself) and ``finish()`` (returns
            ``(G, C)``); a context manager that finishes on a clean exit.

        Raises
        ------
        ValueError
            ``position_basis`` on a layer that is not a Conv2d, both
            ``position_basis`` and ``target_width``, or a ``target_width`` < 1.
        """
        if position_basis is not None and not isinstance(self, Conv2d):
            raise ValueError(f"{self!r} has no output positions: position_basis applies to Conv2d layers only")
        if position_basis is not None and target_width is not None:
            raise ValueError("give position_basis or target_width, not both: the basis sets the width of C")
        if target_width is not None:
            target_width = _positive_int("target_width", target_width)
        return _LayerStatistics(self, G, C, scratch_bytes, samples, position_basis, target_width)

    def _statistics_kernel(self, G, C, x, z, scratch_bytes, samples, position_basis=None):
        """What adds checked batches like the first one, (x, z): an object with update(x, z) and finish()."""
        raise NotImplementedError

    def ls_rows(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        """The least-squares input A of a batch: one row per sample (Dense) or patch (Conv2d), bias last.

        Parameters
        ----------
        x : ndarray of shape (B, *input_shape)

        Returns
        -------
        ndarray of shape (B * rows_per_sample, n_inputs), dtype of x (float)
        """
        raise NotImplementedError

    def rows_per_sample(self, input_shape: Sequence[int]) -> int:
        """Rows of A each sample of per-sample shape ``input_shape`` contributes (1, or out_h * out_w patches)."""
        return 1

    def gram_flops(self, input_shape: Sequence[int], n_samples: int) -> float:
        """Flops of A^T A over ``n_samples`` samples by the kernels the layer uses.

        Parameters
        ----------
        input_shape : sequence of int
            Per-sample input shape.
        n_samples : int

        Returns
        -------
        float
            N d^2 for the N rows of A and its d columns (Dense, and the base
            rule); twice the multiply-adds of the method fastls picks (Conv2d).
        """
        d = self.ls_shape(input_shape)[0]
        return float(n_samples) * self.rows_per_sample(input_shape) * d * d

    # -- evaluation ------------------------------------------------------

    def pre_activation(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        """The linear part of the layer (activation not applied) on a batch x of shape (B, *input_shape).

        Raises
        ------
        RuntimeError
            The layer has no weights yet.
        """
        raise NotImplementedError

    def forward(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        """activation(pre_activation(x)) on a batch x of shape (B, *input_shape), in the weight dtype."""
        return self.activation.apply_inplace(self.pre_activation(x))

    def _act_params(self):
        return {"activation": self.activation.config(), "bias": self.bias}


class Dense(TrainableLayer):
    """Fully connected layer: f([x, 1] @ W).

    Parameters
    ----------
    units : int
        Output features.
    activation : str, dict, Activation or None, default="identity"
    bias : bool, default=True

    Notes
    -----
    Input per-sample shape (d,); weights (d + bias, units).
    """

    type_name = "dense"
    _PARAMS = ("units", "activation", "bias")
    _REQUIRED = ("units",)
    units: int

    def __init__(self, units: int, activation: str | Mapping[str, Any] | Activation | None = "identity",
                 bias: bool = True) -> None:
        self.units = _positive_int("units", units)
        super().__init__(activation, bias)

    @property
    def n_outputs(self) -> int:
        return self.units

    def _params(self):
        return {"units": self.units, **self._act_params()}

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        input_shape = _as_shape("input_shape", input_shape)
        if len(input_shape) != 1:
            raise ValueError(f"Dense expects a flat per-sample input (d,), got {input_shape}; add a Flatten before it")
        return (self.units,)

    def _n_inputs(self, input_shape):
        return input_shape[0] + self.bias

    def accumulate(self, G: npt.NDArray[np.floating], C: npt.NDArray[np.floating], x: npt.ArrayLike,
                   z: npt.ArrayLike, *, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        """G += [x, 1]^T [x, 1] (upper triangle), C += [x, 1]^T z.

        Parameters
        ----------
        G : ndarray of shape (d + bias, d + bias), float32 or float64
            Writable, C- or F-contiguous; only the upper triangle is updated.
        C : ndarray of shape (d + bias, units), dtype of G
        x : ndarray of shape (B, d)
            float32 or float64 (float32 into a float64 G is accumulated in
            float64 per fastls block); other dtypes are cast to the model dtype.
        z : ndarray of shape (B, units)
            Targets; cast to the dtype of x.
        scratch_bytes : int, default=64 MiB
            Bound on the ``[x, 1]`` chunk buffer.
        """
        super().accumulate(G, C, x, z, scratch_bytes=scratch_bytes)

    def _statistics_kernel(self, G, C, x, z, scratch_bytes, samples, position_basis=None):
        return _DenseKernel(self, G, C, scratch_bytes)

    _INPUT_NDIM, _INPUT_WHAT = 2, "(B, d)"

    def _target_shapes(self, x):
        return [(x.shape[0], self.units)]

    def ls_rows(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        x = self._ls_input(x, self._INPUT_NDIM, self._INPUT_WHAT)
        if not self.bias:
            return x
        A = np.empty((x.shape[0], x.shape[1] + 1), dtype=x.dtype)
        A[:, :-1] = x
        A[:, -1] = 1
        return A

    def pre_activation(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        """x @ W[:d] + W[d].

        Parameters
        ----------
        x : ndarray of shape (B, d)
            Cast to the weight dtype.

        Returns
        -------
        ndarray of shape (B, units), weight dtype
        """
        W = self._require_weights()
        x = _as_float(x, W.dtype)
        _check_batch(self, x, 2, "(B, d)")
        d = W.shape[0] - self.bias
        if x.shape[1] != d:
            raise ValueError(f"{self!r} expects input of shape (B, {d}), got {x.shape}")
        # Through fastls, not NumPy: one BLAS thread pool for the forward pass and the statistics.
        out = fastls.matmul(x, W[:d], check_finite=False)
        if self.bias:
            out += W[d]
        return out


class Conv2d(TrainableLayer):
    """2-D convolution on NHWC images, as im2col patches @ W.

    Parameters
    ----------
    filters : int
        Output channels.
    kernel_size : int or (int, int)
    stride : int or (int, int), default=1
    padding : {"valid", "same"}, int or (int, int), default="valid"
        Zero padding on both sides; "same" needs stride 1 and an odd kernel
        (the fastls convention).
    activation : str, dict, Activation or None, default="identity"
    bias : bool, default=True

    Notes
    -----
    Input per-sample shape (H, W, channels); output (out_h, out_w, filters)
    with ``out = (H + 2 p - k) // s + 1``. Weights have shape
    (kh * kw * channels + bias, filters), rows ordered (ky, kx, channel) as
    the columns of :func:`fastls.im2col`; the bias row is last. This is a
    cross-correlation (no kernel flip), as in PyTorch.
    """

    type_name = "conv2d"
    _PARAMS = ("filters", "kernel_size", "stride", "padding", "activation", "bias")
    _REQUIRED = ("filters", "kernel_size")
    filters: int
    kernel_size: tuple[int, int]
    stride: tuple[int, int]
    padding: str | tuple[int, int]

    def __init__(self, filters: int, kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: str | int | Sequence[int] = "valid",
                 activation: str | Mapping[str, Any] | Activation | None = "identity", bias: bool = True) -> None:
        self.filters = _positive_int("filters", filters)
        self.kernel_size = _int_pair("kernel_size", kernel_size, 1)
        self.stride = _int_pair("stride", stride, 1)
        if isinstance(padding, str):
            if padding.lower() not in ("valid", "same"):
                raise ValueError(f"padding must be 'valid', 'same', an int or a pair of ints, got {padding!r}")
            padding = padding.lower()
            if padding == "same" and (self.stride != (1, 1) or self.kernel_size[0] % 2 == 0
                                      or self.kernel_size[1] % 2 == 0):
                raise ValueError(
                    f"padding='same' needs stride 1 and an odd kernel size, got kernel_size={self.kernel_size} "
                    f"and stride={self.stride}"
                )
        else:
            padding = _int_pair("padding", padding, 0)
        self.padding = padding
        super().__init__(activation, bias)

    @property
    def n_outputs(self) -> int:
        return self.filters

    def _params(self):
        padding = self.padding if isinstance(self.padding, str) else _pair_config(self.padding)
        return {
            "filters": self.filters,
            "kernel_size": _pair_config(self.kernel_size),
            "stride": _pair_config(self.stride),
            "padding": padding,
            **self._act_params(),
        }

    def output_shape(self, input_shape: Sequence[int]) -> tuple[int, ...]:
        input_shape = _as_shape("input_shape", input_shape)
        if len(input_shape) != 3:
            raise ValueError(f"Conv2d expects images (H, W, C), got per-sample shape {input_shape}")
        oh, ow = fastls.conv_output_shape(input_shape[:2], self.kernel_size, self.stride, self.padding)
        return (oh, ow, self.filters)

    def _n_inputs(self, input_shape):
        return self.kernel_size[0] * self.kernel_size[1] * input_shape[2] + self.bias

    def _check_weight_rows(self, n_rows):
        kk = self.kernel_size[0] * self.kernel_size[1]
        if n_rows - self.bias < kk or (n_rows - self.bias) % kk:
            raise ValueError(
                f"{self!r} needs kh * kw * channels + {int(self.bias)} weight rows (kh * kw = {kk}), got {n_rows}"
            )

    def _conv_kwargs(self):
        return {"stride": self.stride, "padding": self.padding, "append_ones": self.bias}

    def accumulate(self, G: npt.NDArray[np.floating], C: npt.NDArray[np.floating], x: npt.ArrayLike,
                   z: npt.ArrayLike, *, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        """G += P^T P (upper triangle), C += P^T T over all patches, streamed.

        P has one row per (image, output position): the (ky, kx, channel)
        patch with a 1 appended when ``bias``. T repeats each image's target
        at every output position. :class:`fastls.ConvStats` never builds P
        whole; on stride-1 maps with enough channels it uses the overlap of
        the patches (exact, fewer multiply-adds).

        Parameters
        ----------
        G : ndarray of shape (n_inputs, n_inputs), float32 or float64
            n_inputs = kh * kw * channels + bias; writable, C- or F-contiguous.
        C : ndarray of shape (n_inputs, filters), dtype of G
        x : ndarray of shape (B, H, W, channels)
        z : ndarray of shape (B, filters), or (B, out_h, out_w, filters)
            Per-image targets (applied at every output position), or one
            target per output position. Cast to the dtype of x.
        scratch_bytes : int, default=64 MiB
        """
        super().accumulate(G, C, x, z, scratch_bytes=scratch_bytes)

    def _statistics_kernel(self, G, C, x, z, scratch_bytes, samples, position_basis=None):
        # The first batch's targets say per image or per position.
        return fastls.ConvStats(G, C, x.shape[1:], self.kernel_size, per_image_targets=z.ndim == 2,
                                scratch_bytes=scratch_bytes, images=samples, position_basis=position_basis,
                                **self._conv_kwargs())

    _INPUT_NDIM, _INPUT_WHAT = 4, "(B, H, W, C)"

    def _target_shapes(self, x):
        B = x.shape[0]
        oh, ow, _ = self.output_shape(x.shape[1:])
        return [(B, self.filters), (B, oh, ow, self.filters)]

    def ls_rows(self, x: npt.ArrayLike) -> npt.NDArray[np.floating]:
        x = self._ls_input(x, self._INPUT_NDIM, self._INPUT_WHAT)
        return fastls.im2col(x, self.kernel_size, **self._conv_kwargs())

    def rows_per_sample(self, input_shape: Sequence[int]) -> int:
        oh, ow, _ = self.output_shape(input_shape)
        return oh * ow

    def gram_flops(self, input_shape: Sequence[int], n_samples: int) -> float:
        im2col_macs, overlap_macs = fastls.tuning.conv_stats_cost(input_shape, self.kernel_size, stride=self.stride,
                                                           padding=self.padding)
        pick = fastls.tuning.conv_stats_method(input_shape, self.kernel_size, stride=self.stride, padding=self.padding,
                                        images=n_samples)
        return 2.0 * n_samples * (overlap_macs if pick == "overlap" else im2col_macs)

    def pre_activation(self, x: npt.ArrayLike, *,
                       scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> npt.NDArray[np.floating]:
        """The convolution (plus bias), NHWC.

        Parameters
        ----------
        x : ndarray of shape (B, H, W, channels)
            Cast to the weight dtype.
        scratch_bytes : int, default=64 MiB
            Bound on the patch matrix of one chunk of images (at least one
            image per chunk).

        Returns
        -------
        ndarray of shape (B, out_h, out_w, filters), weight dtype
        """
        W = self._require_weights()
        x = _as_float(x, W.dtype)
        _check_batch(self, x, 4, "(B, H, W, C)")
        if self._n_inputs(x.shape[1:]) != W.shape[0]:
            channels = (W.shape[0] - self.bias) // (self.kernel_size[0] * self.kernel_size[1])
            raise ValueError(f"{self!r} expects images with {channels} channels (B, H, W, {channels}), got {x.shape}")
        channels = x.shape[3]
        method = fastls.tuning.conv2d_method(self.kernel_size, self.stride, channels, self.filters)
        filters = _winograd_filters(W, channels) if method == "winograd" else None
        # fastls bounds the patches (or transformed tiles) of a chunk of images by scratch_bytes.
        return fastls.conv2d(x, W, self.kernel_size, stride=self.stride, padding=self.padding, bias=self.bias,
                             method=method, filters=filters,
                             scratch_bytes=_positive_int("scratch_bytes", scratch_bytes))


# Winograd transforms of read-only weights, shared like the weights themselves
# (one per layer and process, not one per simulated client): id -> (weakref, U).
_WINOGRAD_FILTERS = {}


def _winograd_filters(W, channels):
    """fastls.winograd_filters(W, channels), kept while W lives when W is read-only (nobody can change it)."""
    if W.flags.writeable:
        return fastls.winograd_filters(W, channels)
    key = id(W)
    held = _WINOGRAD_FILTERS.get(key)
    if held is not None and held[0]() is W:
        return held[1]
    U = fastls.winograd_filters(W, channels)
    U.flags.writeable = False
    _WINOGRAD_FILTERS[key] = (weakref.ref(W, lambda _, key=key: _WINOGRAD_FILTERS.pop(key, None)), U)
    return U


class _LayerStatistics:
    """Checks each batch as the layer's ``accumulate`` did, then hands it to the layer's kernel."""

    def __init__(self, layer, G, C, scratch_bytes, samples=None, position_basis=None, target_width=None):
        self.layer = layer
        self.G, self.C = G, C
        self.scratch_bytes = _positive_int("scratch_bytes", scratch_bytes)
        self.samples = samples
        self.position_basis = position_basis
        self.target_width = target_width
        self._kernel = None

    def update(self, x, z):
        layer = self.layer
        x = layer._ls_input(x, layer._INPUT_NDIM, layer._INPUT_WHAT)
        if self.position_basis is not None:
            shapes, width = [(x.shape[0], self.position_basis.shape[2])], self.position_basis.shape[3]
        elif self.target_width is not None:
            shapes, width = [(x.shape[0], self.target_width)], self.target_width
        else:
            shapes, width = layer._target_shapes(x), None
        z = layer._ls_target(z, x.shape[0], x.dtype, shapes)
        layer._check_stats(self.G, self.C, layer._n_inputs(x.shape[1:]), width)
        if x.shape[0] == 0:
            return self
        if self._kernel is None:
            self._kernel = layer._statistics_kernel(self.G, self.C, x, z, self.scratch_bytes, self.samples or len(x),
                                                    self.position_basis)
        self._kernel.update(x, z)
        return self

    def finish(self):
        if self._kernel is not None:
            self._kernel.finish()
            self._kernel = None
        return self.G, self.C

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        return False


class _DenseKernel:
    """[x, 1] chunk by chunk in one reusable buffer, one syrk + gemm per chunk.

    The bias could be accumulated separately (G[:d, :d] += x^T x, G[:d, d]
    += sum x, ...), but G[:d, :d] is not a contiguous array, which the
    in-place BLAS kernels need. [x, 1] costs O(B d) copies next to the
    O(B d^2) product and stays within scratch_bytes.
    """

    def __init__(self, layer, G, C, scratch_bytes):
        self.bias, self.G, self.C, self.scratch_bytes = layer.bias, G, C, scratch_bytes

    def update(self, x, z):
        G, C = self.G, self.C
        # gram_update checks x; z only needs its own (cheap, B x m) check.
        if not np.isfinite(z).all():
            raise ValueError("z contains NaN or Inf; expected finite targets")
        if not self.bias:
            fastls.gram_update(G, x)
            fastls.cross_update(C, x, z, check_finite=False)
            return
        B, d = x.shape
        rows = max(1, min(B, _DENSE_CHUNK_ROWS, self.scratch_bytes // ((d + 1) * x.dtype.itemsize)))
        buf = np.empty((rows, d + 1), dtype=x.dtype)
        buf[:, d] = 1
        for start in range(0, B, rows):
            r = min(rows, B - start)
            np.copyto(buf[:r, :d], x[start:start + r])
            fastls.gram_update(G, buf[:r])
            fastls.cross_update(C, buf[:r], z[start:start + r], check_finite=False)

    def finish(self):
        pass


#: Layer classes by config ``"type"``.
LAYER_TYPES = {cls.type_name: cls for cls in (Dense, Conv2d, AvgPool2d, Flatten)}


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

class Model:
    """A sequence of layers with known per-sample shapes.

    Parameters
    ----------
    layers : list of Layer
        Each instance belongs to this model (trainable layers are bound to
        their input shape and to ``dtype``); the same object may not appear
        twice.
    input_shape : tuple of int
        Per-sample input shape, e.g. (60,) or (32, 32, 3) (NHWC images).
    dtype : float32 or float64, default=float64
        Dtype of the weights and of every activation computed by
        :meth:`forward`.

    Attributes
    ----------
    layers : list of Layer
    input_shape : tuple of int
    output_shape : tuple of int
    dtype : numpy.dtype
    trainable : list of int
        Indices into ``layers`` of the TrainableLayers, in order.

    Raises
    ------
    TypeError
        An entry of ``layers`` is not a Layer.
    ValueError
        A layer appears twice, the shapes do not chain, or the dtype is not
        float32 or float64.
    """

    layers: list[Layer]
    input_shape: tuple[int, ...]
    dtype: np.dtype
    trainable: list[int]

    def __init__(self, layers: Iterable[Layer], input_shape: Sequence[int],
                 dtype: npt.DTypeLike = np.float64) -> None:
        layers = list(layers)
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layer {i} must be a fedlayer.models.Layer, got {type(layer).__name__}")
        if len({id(layer) for layer in layers}) != len(layers):
            raise ValueError("the same layer object appears more than once; use separate instances")
        self.input_shape = _as_shape("input_shape", input_shape)
        self.dtype = _float_dtype(dtype)
        shapes = [self.input_shape]
        for i, layer in enumerate(layers):
            try:
                shapes.append(tuple(layer.output_shape(shapes[-1])))
            except ValueError as exc:
                raise ValueError(f"layer {i} ({layer!r}) on input shape {shapes[-1]}: {exc}") from None
        self.layers = layers
        self._shapes = shapes
        self.trainable = [i for i, layer in enumerate(layers) if isinstance(layer, TrainableLayer)]
        for i in self.trainable:
            try:
                layers[i]._bind(shapes[i], self.dtype)
            except ValueError as exc:
                raise ValueError(f"layer {i}: {exc}") from None

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Per-sample output shape of the whole model."""
        return self._shapes[-1]

    def input_shape_of(self, layer_index: int) -> tuple[int, ...]:
        """Per-sample input shape of ``layers[layer_index]``.

        ``layer_index == len(layers)`` gives the model's output shape;
        negative indices count from the end as for lists.

        Raises
        ------
        IndexError
            ``layer_index`` outside ``[-len(layers), len(layers)]``.
        """
        i = operator.index(layer_index)
        n = len(self.layers)
        if i < 0:
            i += n
        if not 0 <= i <= n:
            raise IndexError(f"layer_index must be in [0, {n}], got {layer_index}")
        return self._shapes[i]

    def _check_input(self, x, start):
        x = np.asarray(x)
        expected = self._shapes[start]
        if x.shape[1:] != expected or x.ndim != len(expected) + 1:
            what = "model input" if start == 0 else f"input of layer {start}"
            raise ValueError(f"{what} must have shape (B, {', '.join(map(str, expected))}), got {x.shape}")
        return _as_float(x, self.dtype)

    def _run(self, x, start, stop):
        for layer in self.layers[start:stop]:
            x = layer.forward(x)
        return x

    def forward(self, x: npt.ArrayLike, stop: int | None = None, batch_size: int | None = None, *,
                start: int = 0) -> npt.NDArray[np.floating]:
        """Apply ``layers[start:stop]``.

        Parameters
        ----------
        x : array_like of shape (B, *input_shape_of(start))
            Cast to the model dtype.
        stop : int, optional
            End layer (exclusive); all layers when None. ``stop == start``
            returns x (cast) unchanged.
        batch_size : int, optional
            Process at most this many rows at a time (bounds the activations
            of the wide DCNN layers); the result is the same.
        start : int, default=0
            First layer, when x is already the input of ``layers[start]``
            (e.g. cached activations during layer-wise training).

        Returns
        -------
        ndarray of shape (B, *input_shape_of(stop)), model dtype

        Raises
        ------
        ValueError
            x's shape is not the input of ``layers[start]``, or not
            ``0 <= start <= stop <= len(layers)``.
        RuntimeError
            A trainable layer of ``layers[start:stop]`` has no weights yet.
        """
        n = len(self.layers)
        stop = n if stop is None else operator.index(stop)
        start = operator.index(start)
        if not 0 <= start <= stop <= n:
            raise ValueError(f"need 0 <= start <= stop <= {n}, got start={start}, stop={stop}")
        x = self._check_input(x, start)
        for i in self.trainable:
            if start <= i < stop and self.layers[i].weights is None:
                raise RuntimeError(f"layer {i} ({self.layers[i]!r}) has no weights yet: train it or call set_weights")
        B = x.shape[0]
        if batch_size is None or B <= batch_size:
            return self._run(x, start, stop)
        batch_size = _positive_int("batch_size", batch_size)
        out = np.empty((B, *self._shapes[stop]), dtype=self.dtype)
        for s in range(0, B, batch_size):
            out[s:s + batch_size] = self._run(x[s:s + batch_size], start, stop)
        return out

    def predict(self, x: npt.ArrayLike, batch_size: int = 4096, *, start: int = 0) -> npt.NDArray[np.int64]:
        """Class labels: argmax of the output.

        Parameters
        ----------
        x : array_like of shape (B, *input_shape_of(start))
        batch_size : int, default=4096
        start : int, default=0
            First layer, when x is already the input of ``layers[start]``.

        Returns
        -------
        ndarray of shape (B,), int64
        """
        out = self.forward(x, batch_size=batch_size, start=start)
        if out.shape[0] == 0:
            return np.zeros(0, dtype=np.int64)
        return out.reshape(out.shape[0], -1).argmax(axis=1).astype(np.int64)

    def accuracy(self, x: npt.ArrayLike, y: npt.ArrayLike, batch_size: int = 4096, *,
                 start: int = 0) -> tuple[int, int]:
        """(number of correct predictions, number of samples).

        Parameters
        ----------
        x : array_like of shape (B, *input_shape_of(start))
        y : array_like of shape (B,) integer labels, or (B, n_classes)
            one-hot / score rows (their argmax is the label).
        batch_size : int, default=4096
        start : int, default=0
            As in :meth:`predict`.

        Returns
        -------
        (int, int)
            Correct predictions and samples; (0, 0) for an empty batch.

        Raises
        ------
        ValueError
            y's shape does not match x, or y holds non-integer labels.
        """
        y = np.asarray(y)
        n_classes = math.prod(self.output_shape)
        if y.ndim == 2 and y.shape[1] == n_classes:
            y = y.argmax(axis=1)
        if y.ndim != 1 or y.shape[0] != np.shape(x)[0]:
            raise ValueError(f"y must have shape ({np.shape(x)[0]},) or ({np.shape(x)[0]}, {n_classes}) (one-hot or "
                             f"score rows of the {n_classes} classes), got {y.shape}")
        if y.size and y.dtype.kind not in "iub":
            if not np.array_equal(y, np.round(y)):
                raise ValueError(f"y must hold integer class labels, got values such as {y[y != np.round(y)][0]!r}")
        if y.shape[0] == 0:
            return 0, 0
        return int((self.predict(x, batch_size=batch_size, start=start) == y).sum()), int(y.shape[0])

    def n_parameters(self) -> int:
        """Number of weights, biases included (whether set or not)."""
        return sum(math.prod(self.layers[i].ls_shape(self._shapes[i])) for i in self.trainable)

    def copy(self) -> Model:
        """A new Model with the same structure and copies of the weights."""
        new = Model.from_config(self.config())
        for i in self.trainable:
            if self.layers[i].weights is not None:
                new.layers[i].set_weights(self.layers[i].weights)
        return new

    def config(self) -> dict[str, Any]:
        """JSON-able structure (no weights): input_shape, dtype, layers."""
        return {
            "input_shape": list(self.input_shape),
            "dtype": self.dtype.name,
            "layers": [layer.config() for layer in self.layers],
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Model:
        """Model from :meth:`config` output (weights unset).

        Raises
        ------
        ValueError
            Not a model config (missing or unknown keys), or layers that
            :func:`model_from_layers` refuses.
        """
        if not isinstance(config, Mapping) or "layers" not in config or "input_shape" not in config:
            raise ValueError("a model config is a dict with keys 'input_shape', 'layers' and optionally 'dtype'")
        unknown = set(config) - {"input_shape", "layers", "dtype"}
        if unknown:
            raise ValueError(f"unknown model config keys {sorted(unknown)}; accepted: input_shape, layers, dtype")
        return model_from_layers(config["layers"], tuple(config["input_shape"]), config.get("dtype", "float64"))

    def save(self, path: str | os.PathLike, metadata: Mapping[str, Any] | None = None) -> None:
        """Write an .npz file: JSON config, JSON metadata, weights per layer.

        Parameters
        ----------
        path : str or os.PathLike
            Written exactly (no suffix added), atomically through a temporary
            file in the same directory.
        metadata : dict, optional
            JSON-able; NumPy scalars and arrays are converted to Python
            numbers and lists.

        Raises
        ------
        TypeError
            ``metadata`` is not a dict, or holds a value JSON cannot hold.

        Notes
        -----
        Weights are stored under ``weights_<layer index>`` for the layers that
        have them; the file loads with ``allow_pickle=False``.
        """
        metadata = {} if metadata is None else metadata
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
        arrays = {
            "format": np.array(_FORMAT),
            "config": np.array(json.dumps(self.config())),
            "metadata": np.array(json.dumps(dict(metadata), default=_json_default)),
        }
        for i in self.trainable:
            if self.layers[i].weights is not None:
                arrays[f"weights_{i}"] = self.layers[i].weights
        path = Path(path)
        # A name of its own per call (not per process): two threads saving one path must not share it.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        tmp = Path(tmp)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()

    @classmethod
    def load(cls, path: str | os.PathLike) -> tuple[Model, dict[str, Any]]:
        """Read a file written by :meth:`save`.

        Parameters
        ----------
        path : str or os.PathLike

        Returns
        -------
        (Model, dict)
            The model with its saved weights, and the metadata.

        Raises
        ------
        ValueError
            If the file is not a fedlayer model file, or is truncated or damaged
            (a missing file stays FileNotFoundError).
        """
        try:
            return cls._load(path)
        except (EOFError, KeyError, zipfile.BadZipFile, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a readable fedlayer model file ({type(err).__name__}: {err})") from None

    @classmethod
    def _load(cls, path):
        try:
            data = np.load(path, allow_pickle=False)
        except ValueError:  # e.g. a text file, which NumPy takes for pickled data (and suggests unpickling)
            raise ValueError(f"{path} is not a fedlayer model file (not a NumPy .npz archive)") from None
        if not isinstance(data, np.lib.npyio.NpzFile):  # a .npy file: one array, not a model
            raise ValueError(f"{path} is not a fedlayer model file (it holds one array, not a .npz archive)")
        with data:
            if "format" not in data.files or str(data["format"]) != _FORMAT:
                raise ValueError(f"{path} is not a fedlayer model file (expected format {_FORMAT!r})")
            model = cls.from_config(json.loads(str(data["config"])))
            metadata = json.loads(str(data["metadata"]))
            for name in data.files:
                if not name.startswith("weights_"):
                    continue
                i = int(name[len("weights_"):])
                if i not in model.trainable:
                    raise ValueError(f"{path}: weights stored for layer {i}, which is not trainable")
                try:
                    model.layers[i].set_weights(data[name])
                except (TypeError, ValueError) as err:
                    raise ValueError(f"{path}: {err}") from None
        return model, metadata

    def __repr__(self) -> str:
        inner = ",\n    ".join(repr(layer) for layer in self.layers)
        return f"Model(input_shape={self.input_shape}, dtype={self.dtype.name}, layers=[\n    {inner}\n])"


def _json_default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"metadata value of type {type(obj).__name__} is not JSON-serializable")


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------

#: Names accepted by :func:`build_model`.
KNOWN_MODELS = ("lr", "dnn", "dcnn")
#: Zero paddings :func:`build_model` accepts for the DCNN's convolutions.
DCNN_PADDINGS = ("valid", "same")


def check_padding(model: str, padding: str) -> None:
    """Refuse a ``padding`` that :func:`build_model` does not take for ``model`` (a name in KNOWN_MODELS).

    Raises
    ------
    ValueError
        ``padding`` is not in :data:`DCNN_PADDINGS`, or is not "valid" for a
        model without convolutions.
    """
    if padding not in DCNN_PADDINGS:
        raise ValueError(f"padding must be one of {', '.join(map(repr, DCNN_PADDINGS))}, got {padding!r}")
    if padding != "valid" and model != "dcnn":
        raise ValueError(f"padding={padding!r} applies to the dcnn model only (the {model!r} model has no "
                         f"convolutions); keep padding='valid'")


def build_model(name: str, input_shape: Sequence[int], n_classes: int, *, width: float = 1.0,
                dtype: npt.DTypeLike = np.float64, negative_slope: float = 0.01, padding: str = "valid") -> Model:
    """One of the paper's models (section 5.1), weights unset.

    Parameters
    ----------
    name : {"lr", "dnn", "dcnn"}
        * ``"lr"``: [Flatten] + Dense(n_classes). The paper's multinomial
          logistic regression; the softmax does not change the argmax and
          analytic training fits the linear scores, so the output is linear.
        * ``"dnn"``: [Flatten] + Dense(128, relu) + Dense(64, relu) +
          Dense(n_classes): two hidden layers [128, 64] with ReLU.
        * ``"dcnn"``: Conv(5x5, 512) LeakyReLU, AvgPool(2x2),
          Conv(3x3, 1024) LeakyReLU, AvgPool(2x2), Conv(3x3, 2048) LeakyReLU,
          Conv(3x3, 2048) LeakyReLU, Flatten, Dense(n_classes).
        Flatten is inserted only for image (multi-dimensional) inputs.
    input_shape : tuple of int
        Per-sample shape: (d,) or (H, W, C); "dcnn" needs (H, W, C).
    n_classes : int
    width : float, default=1.0
        Multiplies the hidden widths (the DCNN channel counts and the DNN
        hidden units): ``max(1, round(c * width))``. Narrow versions keep
        tests fast; the output layer always has n_classes units.
    dtype : float32 or float64, default=float64
    negative_slope : float, default=0.01
        Slope of the DCNN's LeakyReLUs (PyTorch's default).
    padding : {"valid", "same"}, default="valid"
        Zero padding of the DCNN's convolutions (the paper does not say;
        see Notes). The other models have no convolutions and must keep
        "valid".

    Returns
    -------
    Model

    Raises
    ------
    ValueError
        Unknown name, a non-positive width or n_classes, a padding the model
        does not take (:func:`check_padding`), or "dcnn" on inputs that are
        not images.

    Notes
    -----
    The paper does not give the DCNN's padding. 'valid' (the default,
    PyTorch's) keeps the full-width classifier's least-squares Gram at
    8193 x 8193 on 32x32x3 images, where 'same' makes it 131073 x 131073;
    docs/results/fedlayer_notes.md gives the sizes and what each padding
    measured.
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(repr(m) for m in KNOWN_MODELS)}")
    input_shape = _as_shape("input_shape", input_shape)
    n_classes = _positive_int("n_classes", n_classes)
    check_padding(key, padding)
    if isinstance(width, bool) or not isinstance(width, numbers.Real) or not math.isfinite(width) or width <= 0:
        raise ValueError(f"width must be a finite number > 0, got {width!r}")

    def scaled(c):
        return max(1, int(round(c * width)))

    flatten = [Flatten()] if len(input_shape) > 1 else []
    if key == "lr":
        layers = flatten + [Dense(n_classes)]
    elif key == "dnn":
        layers = flatten + [Dense(scaled(128), "relu"), Dense(scaled(64), "relu"), Dense(n_classes)]
    else:
        if len(input_shape) != 3:
            raise ValueError(f"the dcnn model needs image inputs (H, W, C), got input_shape {input_shape}")
        layers = _dcnn_layers(scaled, n_classes, negative_slope, padding)
    return Model(layers, input_shape, dtype)


def _dcnn_layers(scaled, n_classes, negative_slope, padding):
    """The layers of :func:`build_model`'s "dcnn"; ``scaled(c)`` is the width of c channels."""

    def leaky():
        return LeakyReLU(negative_slope)

    return [
        Conv2d(scaled(512), 5, padding=padding, activation=leaky()),
        AvgPool2d(2),
        Conv2d(scaled(1024), 3, padding=padding, activation=leaky()),
        AvgPool2d(2),
        Conv2d(scaled(2048), 3, padding=padding, activation=leaky()),
        Conv2d(scaled(2048), 3, padding=padding, activation=leaky()),
        Flatten(),
        Dense(n_classes),
    ]


def model_from_layers(specs: Iterable[Mapping[str, Any]], input_shape: Sequence[int],
                      dtype: npt.DTypeLike = np.float64) -> Model:
    """Model from a list of layer dicts (user-defined architectures).

    Parameters
    ----------
    specs : list of dict
        Each ``{"type": <name>, **params}`` with type one of ``"dense"``,
        ``"conv2d"``, ``"avgpool2d"``, ``"flatten"`` (case-insensitive) and
        params the constructor arguments of :class:`Dense`, :class:`Conv2d`,
        :class:`AvgPool2d`, :class:`Flatten`, e.g.::

            [{"type": "conv2d", "filters": 8, "kernel_size": 3, "activation": "relu"},
             {"type": "avgpool2d"}, {"type": "flatten"}, {"type": "dense", "units": 10}]

        Activations are names or dicts such as
        ``{"name": "leaky_relu", "negative_slope": 0.1}``.
    input_shape : tuple of int
    dtype : float32 or float64, default=float64

    Returns
    -------
    Model

    Raises
    ------
    ValueError
        Unknown type, unknown/missing/invalid parameter (the message names
        the layer index, the key and the accepted keys), or shapes that do not
        chain.
    """
    if isinstance(specs, (str, bytes, Mapping)) or not hasattr(specs, "__iter__"):
        raise ValueError(f"layer specs must be a list of dicts, got {type(specs).__name__}")
    types = ", ".join(repr(t) for t in LAYER_TYPES)
    layers = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, Mapping):
            raise ValueError(f"layer {i}: expected a dict with a 'type' key, got {spec!r}")
        if "type" not in spec:
            raise ValueError(f"layer {i}: missing key 'type'; accepted types: {types}")
        kind = spec["type"]
        cls = LAYER_TYPES.get(kind.lower()) if isinstance(kind, str) else None
        if cls is None:
            raise ValueError(f"layer {i}: unknown type {kind!r}; accepted types: {types}")
        accepted = ", ".join(("type",) + cls._PARAMS)
        params = {k: v for k, v in spec.items() if k != "type"}
        for key in params:
            if key not in cls._PARAMS:
                raise ValueError(f"layer {i} ({cls.type_name}): unknown key {key!r}; accepted keys: {accepted}")
        for key in cls._REQUIRED:
            if key not in params:
                raise ValueError(f"layer {i} ({cls.type_name}): missing key {key!r}; accepted keys: {accepted}")
        try:
            layers.append(cls(**params))
        except ValueError as exc:
            # Constructor messages start with the offending parameter name.
            raise ValueError(f"layer {i} ({cls.type_name}): invalid value: {exc}; accepted keys: {accepted}") from None
    return Model(layers, input_shape, dtype)
