"""Streaming convolution statistics: G += P^T P and C += P^T T without holding the patch matrix P."""

from __future__ import annotations

from typing import Literal

import numpy as np

from . import _kernels
from ._overlap import (OVERLAP_CHUNK_BYTES, _assemble_blocks, _assembly_plan, _group_products, _overlap_plan,
                       _pick_conv_method)
from ._patches import IntPair, Padding, _conv_geometry, _image_shape, im2col
from ._products import DEFAULT_BLOCK_ROWS, DEFAULT_TILE, matmul
from ._threads import sized_threads
from ._validation import (_check_array, _check_count, _check_disjoint, _check_finite, _check_output,
                          _check_pair_dtypes, _layout, _overflow_error, _squares_fit)
from ._workspace import DEFAULT_SCRATCH_BYTES, recycled_array

__all__ = ["ConvStats", "conv_gram_update"]


def conv_gram_update(G: np.ndarray, C: np.ndarray, images: np.ndarray, targets: np.ndarray, kernel_size: IntPair, *,
                     stride: IntPair = 1, padding: Padding = 0, append_ones: bool = False,
                     scratch_bytes: int = DEFAULT_SCRATCH_BYTES, block_rows: int = DEFAULT_BLOCK_ROWS,
                     check_finite: bool = True,
                     method: Literal["auto", "im2col", "overlap"] = "auto") -> tuple[np.ndarray, np.ndarray]:
    """G += P^T P and C += P^T T for the patch matrix P of a batch, streamed.

    One call of :class:`ConvStats`; see there for the two exact methods.

    Parameters
    ----------
    G : ndarray of shape (d, d), d = kh * kw * channels + append_ones
        Upper-triangle accumulator (float32, or float64 for either input dtype).
    C : ndarray of shape (d, m), dtype of G
    images : ndarray of shape (B, H, W, channels), float32 or float64 (NHWC)
    targets : ndarray of shape (B, m) or (B, out_h, out_w, m), dtype of images
        Per-image targets (e.g. an encoded label) apply at every output
        position; that case costs a patch sum per image instead of a
        d x m product per patch.
    kernel_size, stride, padding, append_ones : as in :func:`im2col`
    scratch_bytes : int, default=64 MiB
        Upper bound on the working memory of the patches or gathered pixels,
        whatever B is.
    block_rows : int, default=4096
        Float32 block on the float32-into-float64 path.
    check_finite : bool, default=True
    method : {'auto', 'im2col', 'overlap'}, default='auto'

    Returns
    -------
    (G, C) : the same arrays, updated.

    Raises
    ------
    TypeError, ValueError
        As :class:`ConvStats` and :meth:`ConvStats.update`.
    """
    if not isinstance(images, np.ndarray):
        raise TypeError(f"images must be a NumPy array, got {type(images).__name__}")
    if not isinstance(targets, np.ndarray):
        raise TypeError(f"targets must be a NumPy array, got {type(targets).__name__}")
    _check_array("images", images, 4)
    stats = ConvStats(G, C, images.shape[1:], kernel_size, stride=stride, padding=padding,
                      append_ones=append_ones, per_image_targets=targets.ndim == 2, method=method,
                      scratch_bytes=scratch_bytes, block_rows=block_rows, images=images.shape[0])
    stats.update(images, targets, check_finite=check_finite)
    return stats.finish()


class ConvStats:
    """Running G += P^T P and C += P^T T over batches of images (P = patches).

    Two exact methods:

    * ``'im2col'`` builds patch rows chunk by chunk in a scratch buffer and
      multiplies them (any stride and padding, per-image or per-position
      targets).
    * ``'overlap'`` (stride 1, per-image targets) uses that neighbouring
      patches share pixels: block (a, b) of P^T P is the channel correlation
      of the map at displacement b - a, summed over the window of a. Each
      displacement is multiplied once per cell of the map (cells: the pieces
      into which the window edges cut it), cells that lie in the same windows
      in one product, and the k^2 x k^2 blocks are assembled from those
      products: about 2.85x fewer multiply-adds than im2col on a 14 x 14 map
      with a 3 x 3 kernel. The products are kept per group (one
      channels x channels matrix each, :attr:`state_bytes`) across calls and
      added into G's blocks by :meth:`finish`, so small batches do not pay
      a pass over G each; :meth:`finish` writes each block once from all the
      products feeding it, reading each product once, lines of the blocks
      split over the allowed threads. The
      products' memory is reused by the next ConvStats of the same shape
      (:func:`fastls.recycled_array`); :meth:`finish` leaves them zeroed,
      so that one's first products accumulate into them instead of BLAS
      zeroing them first.

    Parameters
    ----------
    G : ndarray of shape (d, d), d = kh * kw * channels + append_ones
        Upper-triangle accumulator, float32 or float64, C- or F-contiguous.
    C : ndarray of shape (d, m), dtype of G
    image_shape : (H, W, channels)
    kernel_size, stride, padding, append_ones : as in :func:`im2col`
    per_image_targets : bool, default=True
        Targets of shape (B, m), one per image (else (B, out_h, out_w, m)).
    method : {'auto', 'im2col', 'overlap'}, default='auto'
        'auto' takes the overlap path where it applies, the map has at
        least ``OVERLAP_MIN_CHANNELS`` channels and its multiply-adds are at
        most ``OVERLAP_MAX_COST_RATIO`` of im2col's (:func:`conv_stats_cost`).
    scratch_bytes : int, default=64 MiB
        Bound on the patch chunk or the gathered pixels of one call. The
        overlap gathers at most ``OVERLAP_CHUNK_BYTES`` (16 MiB) of pixels
        at a time, so that a product's operands are still in cache when BLAS
        packs them, unless that would
        leave the products fewer rows than half their channels: then
        writing the c x c products costs more than the cache saves.
    block_rows : int, default=4096
        On the float32-into-float64 path, rows summed in float32 before a
        product is added to the float64 G.
    images : int, optional
        Images the caller will add before :meth:`finish`, when known: 'auto'
        then weighs the overlap's one pass over G against that many images
        (:func:`conv_stats_method`).
    position_basis : ndarray of shape (out_h, out_w, k, m), optional
        Per-position targets in factored form: the target of image n at
        output position (y, x) is ``targets[n] @ position_basis[y, x]``, and
        :meth:`update` takes the (B, k) coordinates (e.g. one-hot labels when
        each position has its own label code). C is then formed from the k
        target-weighted sums of the images (patches are linear in the image):
        one im2col of k images and one (d, k P) x (k P, m) product at
        :meth:`finish`, so G keeps the per-image methods (the overlap)
        instead of im2col's per-position path.

    Notes
    -----
    G and C hold the complete statistics only after :meth:`finish` (or the
    end of a ``with`` block); :meth:`update` may add part of them earlier.

    Raises
    ------
    TypeError
        If G or C is not a float32/float64 array, or their dtypes differ.
    ValueError
        If G or C does not match the patches, is read-only or non-contiguous,
        the geometry is invalid, or ``method`` does not apply to it.

    Examples
    --------
    >>> import numpy as np
    >>> import fastls
    >>> G, C = np.zeros((19, 19)), np.zeros((19, 4))       # 3 x 3 kernels over 2 channels, plus the bias
    >>> batches = [(np.ones((2, 6, 6, 2)), np.ones((2, 4))) for _ in range(3)]
    >>> with fastls.ConvStats(G, C, (6, 6, 2), 3, append_ones=True) as stats:
    ...     for images, targets in batches:
    ...         _ = stats.update(images, targets)             # returns the ConvStats
    >>> float(G[-1, -1])                                  # the bias row's square summed over 6 x 16 patches
    96.0
    """

    def __init__(self, G: np.ndarray, C: np.ndarray, image_shape: tuple[int, int, int], kernel_size: IntPair, *,
                 stride: IntPair = 1, padding: Padding = 0, append_ones: bool = False,
                 per_image_targets: bool = True, method: Literal["auto", "im2col", "overlap"] = "auto",
                 scratch_bytes: int = DEFAULT_SCRATCH_BYTES, block_rows: int = DEFAULT_BLOCK_ROWS,
                 images: int | None = None, position_basis: np.ndarray | None = None) -> None:
        _check_output("G", G, 2)
        _check_output("C", C, 2)
        H, W, channels = _image_shape(image_shape)
        geometry = _conv_geometry((H, W), kernel_size, stride, padding)
        kh, kw, sh, sw, ph, pw, out_h, out_w = geometry
        d = kh * kw * channels + int(bool(append_ones))
        if G.shape != (d, d):
            raise ValueError(f"G must have shape ({d}, {d}) (kh*kw*channels + append_ones), got {G.shape}")
        if C.ndim != 2 or C.shape[0] != d:
            raise ValueError(f"C must have shape ({d}, m), got {C.shape}")
        if G.dtype != C.dtype:
            raise TypeError(f"G and C must share a dtype, got {G.dtype} and {C.dtype}")
        _check_disjoint("C", C, G=G)
        self.G, self.C = G, C
        self.image_shape = (H, W, channels)
        self.geometry = geometry
        self.append_ones = bool(append_ones)
        self.per_image_targets = bool(per_image_targets)
        self._factored = None  # with a position basis: (basis, weighted image sums, target column sums)
        if position_basis is not None:
            _check_array("position_basis", position_basis, 4)
            if not per_image_targets:
                raise ValueError("position_basis takes per-image target coordinates: per_image_targets must be True")
            if position_basis.shape[:2] != (out_h, out_w) or position_basis.shape[3] != C.shape[1]:
                raise ValueError(f"position_basis must have shape ({out_h}, {out_w}, k, {C.shape[1]}) "
                                 f"(out_h, out_w, k, m), got {position_basis.shape}")
            _check_finite("position_basis", position_basis)
            k = position_basis.shape[2]
            self._factored = (np.asarray(position_basis, dtype=np.float64),
                              np.zeros((k, H * W * channels)), np.zeros(k))
            # The per-image kernels still form (sum of patches)^T targets: into a scratch (d, k) C.
            self.C = np.zeros((d, k), dtype=G.dtype)
            self._C_out = C
        self.scratch_bytes = _check_count("scratch_bytes", scratch_bytes)
        self.block_rows = _check_count("block_rows", block_rows)
        self.method = _pick_conv_method(method, self.image_shape, (kh, kw), (sh, sw), (ph, pw),
                                        self.per_image_targets, images)
        self._dtype = None        # of the images, fixed by the first update
        self._partial = None      # overlap: per-group products, their pending float32 rows, zeroed ones

    @property
    def state_bytes(self) -> int:
        """Memory held between calls by the per-group products (overlap; 0 otherwise)."""
        if self.method != "overlap":
            return 0
        kh, kw, _, _, _, _, out_h, out_w = self.geometry
        n_groups = len(_overlap_plan(kh, kw, out_h, out_w)[0])
        itemsize = (self._dtype or self.G.dtype).itemsize
        return n_groups * self.image_shape[2] ** 2 * itemsize

    def _check_batch(self, images, targets):
        _check_array("images", images, 4)
        if images.shape[1:] != self.image_shape:
            raise ValueError(f"images must have shape (B, {', '.join(map(str, self.image_shape))}), got {images.shape}")
        if not isinstance(targets, np.ndarray):
            raise TypeError(f"targets must be a NumPy array, got {type(targets).__name__}")
        if targets.dtype != images.dtype:
            raise TypeError(f"targets must have the dtype of images ({images.dtype}), got {targets.dtype}")
        B, m = images.shape[0], self.C.shape[1]
        out_h, out_w = self.geometry[-2:]
        expected = (B, m) if self.per_image_targets else (B, out_h, out_w, m)
        if targets.shape != expected:
            kind = "per-image" if self.per_image_targets else "per-position"
            raise ValueError(f"targets must have shape {expected} ({kind} targets), got {targets.shape}")
        mixed = _check_pair_dtypes("G", self.G, "images", images)
        for name, out in (("G", self.G), ("C", getattr(self, "_C_out", self.C))):
            _check_disjoint(name, out, images=images, targets=targets)
        if self._dtype is not None and images.dtype != self._dtype:
            raise TypeError(f"images must keep the dtype of the first batch ({self._dtype}), got {images.dtype}")
        return mixed

    def update(self, images: np.ndarray, targets: np.ndarray, *, check_finite: bool = True) -> ConvStats:
        """Add one batch.

        Parameters
        ----------
        images : ndarray of shape (B, H, W, channels), float32 or float64 (NHWC)
        targets : ndarray of shape (B, m), or (B, out_h, out_w, m) without
            ``per_image_targets``; dtype of images
        check_finite : bool, default=True
            Refuse NaN/Inf before anything is added.

        Returns
        -------
        self
        """
        mixed = self._check_batch(images, targets)
        if images.shape[0] == 0:
            return self
        images = np.ascontiguousarray(images)
        targets = np.ascontiguousarray(targets.reshape(images.shape[0], -1) if self.per_image_targets
                                       else targets.reshape(int(np.prod(targets.shape[:-1])), targets.shape[-1]))
        if check_finite:
            # A statistic sums at most this batch's patch rows of products, in the dtype of the images:
            # the bound of _squares_fit (one pass, which also finds NaN/Inf), conservative (a refused batch
            # would need |x| near 1e17 in float32).
            rows = images.shape[0] * self.geometry[-2] * self.geometry[-1]
            for name, A in (("images", images), ("targets", targets)):
                if not _squares_fit(A, rows):
                    _check_finite(name, A)
                    raise _overflow_error(name, A, f"the patch statistics of {images.shape[0]} images")
        self._dtype = images.dtype
        d = self.G.shape[0]
        out_h, out_w = self.geometry[-2:]
        # Counted as im2col + Gram (the overlap method does less of the same kind of work).
        with sized_threads(float(images.shape[0]) * out_h * out_w * d * d):
            if self.method == "overlap":
                self._update_overlap(images, targets, mixed)
            else:
                self._update_im2col(images, targets, mixed)
            if self._factored is not None:
                _, sums, column_sums = self._factored
                # S_j += sum_n targets[n, j] images[n]: a (k x B) x (B x HWC) product in the images'
                # dtype over at most block_rows images, added in float64 (as G's blocks are), on
                # SciPy's BLAS: NumPy's would wake a second thread pool that spins beside it.
                pixels = images.reshape(images.shape[0], -1)
                for first in range(0, images.shape[0], self.block_rows):
                    rows = slice(first, first + self.block_rows)
                    sums += matmul(targets[rows].T, pixels[rows], check_finite=False)
                column_sums += targets.sum(axis=0, dtype=np.float64)
        return self

    def _update_overlap(self, images, targets, mixed):
        kh, kw, _, _, ph, pw, out_h, out_w = self.geometry
        groups, cells, blocks, rows_per_image, macs_per_image = _overlap_plan(kh, kw, out_h, out_w)
        channels, dtype = self.image_shape[2], images.dtype
        d, m = self.G.shape[0], self.C.shape[1]
        itemsize = dtype.itemsize
        # Fixed: the float32 tile of the mixed cross term. Per image: the two
        # gathered operands and its patch sums.
        fixed = min(d, DEFAULT_TILE) * min(m, DEFAULT_TILE) * 4 if mixed else 0
        per_image = (2 * rows_per_image * channels + d) * itemsize
        most = (self.scratch_bytes - fixed) // per_image
        if most < 1:
            raise ValueError(
                f"scratch_bytes={self.scratch_bytes} is too small for the overlap statistics of a "
                f"{'x'.join(map(str, self.image_shape))} map; need at least {fixed + per_image}"
            )
        B = images.shape[0]
        # Cache-sized chunks unless the products would get too thin (class docstring).
        thin = -(-channels // max(1, int(2 * macs_per_image / len(groups))))
        most = min(most, max(OVERLAP_CHUNK_BYTES // per_image, thin))
        chunk = -(-B // -(-B // most))  # equal chunks: no thin remainder
        if self._partial is None:
            # No zeroing: a group's first product overwrites its slot (no pending rows)
            # or, if the slot is known to be zero, accumulates into it.
            acc, clean = _group_products((len(groups), channels, channels), dtype)
            self._partial = (acc, np.zeros(len(groups), dtype=np.intp), clean)
        acc, pending, clean = self._partial
        # Scratch of one call; recycled, as fresh pages cost more to fault in than the gathers.
        buf_a = recycled_array("fastls.ConvStats.gather_a", (chunk * rows_per_image * channels,), dtype, zero=False)
        buf_b = recycled_array("fastls.ConvStats.gather_b", buf_a.shape, dtype, zero=False)
        sums = recycled_array("fastls.ConvStats.patch_sums", (chunk, d), dtype, zero=False)
        _kernels.overlap_accumulate(acc, pending, clean, *_layout(self.G), images, targets, groups, cells, blocks,
                                    buf_a, buf_b, sums, self.G, self.C, *_layout(self.C), kh, kw, ph, pw,
                                    out_h, out_w, self.append_ones, chunk, mixed, self.block_rows, DEFAULT_TILE)

    def _update_im2col(self, images, targets, mixed):
        kh, kw, sh, sw, ph, pw, out_h, out_w = self.geometry
        d, m = self.G.shape[0], self.C.shape[1]
        itemsize = images.dtype.itemsize
        tile = min(DEFAULT_TILE, d)
        tile_bytes = tile * max(tile, min(DEFAULT_TILE, m)) * 4 if mixed else 0
        row_bytes = d * itemsize
        per_img_rows = out_h * out_w
        per_image = self.per_image_targets
        # Chunk rows r and patch-sum rows s = r / per_img_rows + 2 share the budget.
        budget_rows = (self.scratch_bytes - tile_bytes) // row_bytes
        rows = int((budget_rows - (2 if per_image else 0)) / (1 + (1 / per_img_rows if per_image else 0)))
        if rows < 1:
            # The smallest budget the split above accepts: one patch row, plus
            # (with per-image targets) the patch-sum rows that go with it.
            need = tile_bytes + row_bytes * (4 if per_image else 1)
            raise ValueError(
                f"scratch_bytes={self.scratch_bytes} is too small for patches of {d} values; need at least {need}"
            )
        rows = min(rows, images.shape[0] * per_img_rows)
        scratch = np.empty((rows, d), dtype=images.dtype)
        sums = np.zeros((rows // per_img_rows + 2 if per_image else 1, d), dtype=images.dtype)
        geometry = (kh, kw, sh, sw, ph, pw, out_h, out_w, self.append_ones)
        G, C = self.G, self.C
        if mixed:
            _kernels.conv_stats_mixed(G, *_layout(G), C, *_layout(C), images, targets, per_image, scratch, sums,
                                      *geometry, self.block_rows, DEFAULT_TILE)
        else:
            _kernels.conv_stats_same(G, *_layout(G), C, *_layout(C), images, targets, per_image, scratch, sums,
                                     *geometry)

    def finish(self) -> tuple[np.ndarray, np.ndarray]:
        """Add what is still held per group into G; returns (G, C), complete."""
        if self._partial is not None:
            kh, kw, _, _, _, _, out_h, out_w = self.geometry
            _assemble_blocks(*self._partial, _assembly_plan(kh, kw, out_h, out_w), self.G)
            self._partial = None
        if self._factored is not None:
            self._finish_factored()
            return self.G, self._C_out
        return self.G, self.C

    def _finish_factored(self):
        """C += sum_j im2col(S_j)^T B_j over positions, S_j the target-weighted image sums; then restart them."""
        basis, sums, column_sums = self._factored
        kh, kw, sh, sw, ph, pw, out_h, out_w = self.geometry
        k, m = basis.shape[2], basis.shape[3]
        patches = im2col(sums.reshape(k, *self.image_shape), (kh, kw), stride=(sh, sw), padding=(ph, pw))
        # Rows of the patches run (j, y, x); the basis rows must too.
        update = matmul(patches.T, basis.transpose(2, 0, 1, 3).reshape(k * out_h * out_w, m), check_finite=False)
        C = self._C_out
        C[:update.shape[0]] += update.astype(C.dtype, copy=False)
        if self.append_ones:
            # The bias column of a patch is 1: its row of C is sum_j (sum_n targets[n, j]) sum_positions B_j.
            C[-1] += (column_sums @ basis.sum(axis=(0, 1))).astype(C.dtype, copy=False)
        sums[:] = 0.0
        column_sums[:] = 0.0

    def __enter__(self) -> ConvStats:
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        return False
