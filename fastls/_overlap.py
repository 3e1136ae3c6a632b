"""Convolution statistics from the overlap of patches: the plan, its cost, and the choice against im2col.

Neighbouring patches of a stride-1 convolution share pixels, so block (a, b)
of P^T P is the channel correlation of the map at displacement b - a; the
planner here cuts the map into cells that lie in the same kernel windows, and
:class:`fastls.ConvStats` multiplies each displacement once per group of cells.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Literal

import numpy as np

from . import _kernels
from ._patches import IntPair, Padding, _conv_geometry, _image_shape, _pair, conv_output_shape
from ._products import DEFAULT_BLOCK_ROWS
from ._threads import run_spans, threads_for
from ._validation import _layout
from ._workspace import recycled_array

__all__ = ["conv_stats_cost", "conv_stats_method"]

# Pixels the overlap gathers at a time: a product's operands stay in cache while BLAS
# packs them (docs/results/kernels_notes.md). ConvStats' scratch_bytes still bounds it.
OVERLAP_CHUNK_BYTES = 16 * 2**20

# The overlap path pays only where each displacement product is a real matrix
# product: below this many channels the C x C products are too thin for BLAS.
OVERLAP_MIN_CHANNELS = 32
# ... and, when the images per finish are unknown, only where it saves at least
# this share of im2col's multiply-adds.
OVERLAP_MAX_COST_RATIO = 0.8
_CONV_METHODS = ("auto", "im2col", "overlap")


@functools.lru_cache(maxsize=64)
def _overlap_plan(kh, kw, out_h, out_w):
    """Groups of cells per displacement, for a stride-1 kh x kw kernel on a padded map.

    The padded map is (out_h + kh - 1) x (out_w + kw - 1); the window of
    kernel offset (ay, ax) is rows [ay, ay + out_h) x columns [ax, ax + out_w).
    Cutting rows at every window edge makes each window a union of bands;
    the cells of one displacement (dy, dx) that lie in the same set of
    windows form one group, multiplied once and added into the block
    (a, a + delta) of each of those windows.

    Returns
    -------
    groups : int32 array (n_groups, 6): dy, dx, cell range, block range
    cells : int32 array (n_cells, 4): y0, y1, x0, x1
    blocks : int32 array (n_blocks, 2): kernel-offset indices a, b (b > a, or b == a)
    rows_per_image : int
        Rows of the largest group for one image (sizes the gather buffers).
    macs_per_image : float
        Multiply-adds per image per channel^2 (the diagonal at half cost).
    """
    def bands(k, out):
        cuts = sorted({*range(k), *range(out, out + k)})
        return list(zip(cuts[:-1], cuts[1:]))

    def members(band_list, k, out, shift):
        # Offsets a with a and a + shift inside the kernel whose window holds the band.
        valid = range(max(0, -shift), min(k, k - shift))
        return [tuple(a for a in valid if a <= lo and hi <= a + out) for lo, hi in band_list]

    row_bands, col_bands = bands(kh, out_h), bands(kw, out_w)
    groups, cells, blocks = [], [], []
    rows_per_image, macs = 0, 0.0
    for dy in range(kh):
        for dx in range(-(kw - 1), kw):
            if dy == 0 and dx < 0:
                continue  # the transposed block of (0, -dx)
            row_sets = members(row_bands, kh, out_h, dy)
            col_sets = members(col_bands, kw, out_w, dx)
            keys = sorted({(r, c) for r in row_sets if r for c in col_sets if c})
            for r_set, c_set in keys:
                first_cell, first_block = len(cells), len(blocks)
                area = 0
                for (y0, y1), rs in zip(row_bands, row_sets):
                    for (x0, x1), cs in zip(col_bands, col_sets):
                        if rs == r_set and cs == c_set:
                            cells.append((y0, y1, x0, x1))
                            area += (y1 - y0) * (x1 - x0)
                blocks += [(ay * kw + ax, (ay + dy) * kw + ax + dx) for ay in r_set for ax in c_set]
                groups.append((dy, dx, first_cell, len(cells), first_block, len(blocks)))
                rows_per_image = max(rows_per_image, area)
                macs += area * (0.5 if dy == dx == 0 else 1.0)
    as_array = functools.partial(np.array, dtype=np.int32)
    return (as_array(groups).reshape(-1, 6), as_array(cells).reshape(-1, 4), as_array(blocks).reshape(-1, 2),
            rows_per_image, macs)


@functools.lru_cache(maxsize=64)
def _assembly_plan(kh, kw, out_h, out_w):
    """The blocks of G the overlap groups feed, each once: (keys (n, 2), starts (n + 1,), groups), int32.

    Block k is (a, b) = keys[k] and is fed by groups[starts[k]:starts[k + 1]],
    in increasing group order.
    """
    groups, _, blocks, _, _ = _overlap_plan(kh, kw, out_h, out_w)
    feeders = {}
    for g, (*_, first, stop) in enumerate(groups):
        for a, b in blocks[first:stop]:
            feeders.setdefault((int(a), int(b)), []).append(g)
    keys = sorted(feeders)
    starts = np.cumsum([0] + [len(feeders[key]) for key in keys])
    members = [g for key in keys for g in feeders[key]]
    as_array = functools.partial(np.array, dtype=np.int32)
    return as_array(keys).reshape(-1, 2), as_array(starts), as_array(members)


def _assemble_blocks(acc, pending, clean, plan, G):
    """G's blocks += the pending per-group products (threads over disjoint lines), then restart the groups.

    The assembly zeroes the products it reads, so those groups are then clean.
    """
    keys, starts, members = plan
    channels = acc.shape[1]
    # Memory-bound adds; threads_for keeps within the caller's core limit. Threads take
    # disjoint lines of every block.
    threads = min(threads_for(2.0 * len(members) * channels * channels), channels)
    bounds = np.linspace(0, channels, threads + 1).astype(int).tolist()
    ranges = [(first, stop) for first, stop in zip(bounds[:-1], bounds[1:]) if stop > first]
    mixed = G.dtype != acc.dtype

    def assemble(line_range):
        _kernels.overlap_assemble(acc, pending, keys, starts, members, G, *_layout(G), mixed, *line_range)

    run_spans(assemble, ranges)
    clean[pending > 0] = 1
    pending[:] = 0


# Per-group products known to be zero, for the recycled products array:
# (weak reference to that array, one flag per group). A first product then
# accumulates (beta 1) instead of BLAS zeroing 4-16 MB before it.
_zeroed_groups = {}
_zeroed_lock = threading.Lock()


def _group_products(shape, dtype):
    """(products, clean): the recycled (n_groups, c, c) products, and which of them are known to be zero."""
    key = "fastls.ConvStats.overlap"
    with _zeroed_lock:
        acc = recycled_array(key, shape, dtype, zero=False)
        ref, clean = _zeroed_groups.get(key, (None, None))
        if ref is None or ref() is not acc:
            # New memory, or another products array meanwhile: nothing is known to be zero.
            clean = np.zeros(shape[0], dtype=np.uint8)
            _zeroed_groups[key] = (weakref.ref(acc), clean)
    return acc, clean


# Cost of one element of G read and written by a pass over it, in multiply-adds of
# a float32 gemm: memory-bound, so it is the ratio of the machine's gemm rate to
# its memory speed. The overlap's finish writes each block of G once and reads
# each group product (float32) once and zeroes it: half the bytes of a block.
# Fitted to the measured crossovers of the two methods; it also absorbs the thin
# products of the overlap on few images, which run below the gemm rate
# (docs/results/kernels_notes.md).
FOLD_COST_IN_MACS = 295
# A pass of im2col's float32-into-float64 path over G also writes and reads the
# float32 tile of the product: about 1.5 times the bytes of a plain pass.
IM2COL_PASS_COST_IN_MACS = 520


def conv_stats_cost(image_shape: tuple[int, int, int], kernel_size: IntPair, *, stride: IntPair = 1,
                    padding: Padding = 0) -> tuple[float, float | None]:
    """Multiply-adds per image of the patch Gram: (im2col + syrk, overlap or None).

    im2col counts out_h * out_w * d^2 / 2 (syrk's triangle, bias excluded);
    the overlap path counts its displacement products (None where it does
    not apply: stride > 1).

    Parameters
    ----------
    image_shape : (H, W, channels)
    kernel_size, stride, padding : as in :func:`im2col`

    Returns
    -------
    (float, float or None)
    """
    H, W, channels = _image_shape(image_shape)
    kh, kw, sh, sw, ph, pw, out_h, out_w = _conv_geometry((H, W), kernel_size, stride, padding)
    im2col_macs = out_h * out_w * (kh * kw * channels) ** 2 / 2
    if (sh, sw) != (1, 1):
        return im2col_macs, None
    return im2col_macs, _overlap_plan(kh, kw, out_h, out_w)[4] * channels ** 2


def conv_stats_method(image_shape: tuple[int, int, int], kernel_size: IntPair, *, stride: IntPair = 1,
                      padding: Padding = 0, per_image_targets: bool = True,
                      images: int | None = None) -> Literal["im2col", "overlap"]:
    """The method ``method='auto'`` of :class:`ConvStats` takes: 'overlap' or 'im2col'.

    ``images``, the images summed before each ``finish`` when known, adds the
    cost of adding the products into G (memory-bound, ``FOLD_COST_IN_MACS``
    per element) spread over them: on small maps with many channels the
    overlap pays only over enough images.
    """
    return _pick_conv_method("auto", tuple(image_shape), kernel_size, stride, padding, per_image_targets, images)


def _pick_conv_method(method, image_shape, kernel_size, stride, padding, per_image, images=None):
    if method not in _CONV_METHODS:
        raise ValueError(f"method must be one of {_CONV_METHODS}, got {method!r}")
    im2col_macs, overlap_macs = conv_stats_cost(image_shape, kernel_size, stride=stride, padding=padding)
    usable = overlap_macs is not None and per_image
    if method == "overlap" and not usable:
        raise ValueError(
            "method='overlap' needs stride 1 and per-image targets of shape (B, m); "
            f"got stride {stride} and {'per-image' if per_image else 'per-position'} targets"
        )
    if method == "auto":
        if usable and images:
            # Per finish, the overlap writes each block of G once and reads each
            # group product once; im2col passes over G once per block of
            # DEFAULT_BLOCK_ROWS rows.
            kh, kw = _pair("kernel_size", kernel_size)
            out_h, out_w = conv_output_shape(image_shape[:2], kernel_size, stride, padding)
            channels = image_shape[2]
            keys = _assembly_plan(kh, kw, out_h, out_w)[0]
            groups = _overlap_plan(kh, kw, out_h, out_w)[0]  # one product per group, each feeding some block
            d = kh * kw * channels
            passes = -(-images * out_h * out_w // DEFAULT_BLOCK_ROWS)
            overlap_macs += FOLD_COST_IN_MACS * (len(keys) + len(groups) / 2) * channels ** 2 / images
            im2col_macs += IM2COL_PASS_COST_IN_MACS * passes * d * d / 2 / images
        # With the passes over G counted, the cheaper one wins; without them,
        # the overlap must save a margin that covers its one pass.
        ratio = 1.0 if images else OVERLAP_MAX_COST_RATIO
        pays = usable and image_shape[2] >= OVERLAP_MIN_CHANNELS and overlap_macs <= ratio * im2col_macs
        method = "overlap" if pays else "im2col"
    return method
