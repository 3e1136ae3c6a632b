"""What travels between rank 0 and the workers: operations, tags, and messages as a header plus raw buffers.

A message is a small pickled header (``comm.send``/``isend``) whose ``"op"``
entry is an :class:`Op`, followed by the NumPy arrays it refers to as raw
buffers (``Send``/``Isend``), never pickled. :class:`Payload` replaces each
array of a header by a placeholder and collects the buffers; :func:`inflate`
puts the received buffers back. Buffers over ``chunk_bytes`` travel as
several messages (MPI counts are C ints).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..transport import pack_upper, unpack_upper

if TYPE_CHECKING:
    from mpi4py import MPI

#: What the receiver of a buffer needs: its array's shape, dtype string, and whether it travels packed.
Desc = tuple[tuple[int, ...], str, bool]

__all__ = ["CHUNK_BYTES", "TAG_CMD", "TAG_CMD_DATA", "TAG_DATA", "TAG_GROUPS", "TAG_RESULT", "Op", "Payload", "backoff",
           "configured_chunk_bytes", "group_tags", "inflate", "post_receives", "send_buffers", "unwire"]


class Op(enum.Enum):
    """The operation a message carries, under its header's ``"op"`` key."""

    # rank 0 -> worker (TAG_CMD)
    CALL = "call"          # run a method on some of the rank's clients, one RESULT per client
    SUMS = "sums"          # run a method on the rank's clients of one or more groups, summed per group
    STOP = "stop"          # end the worker loop with the header's "status"
    # worker -> rank 0 (TAG_RESULT)
    HELLO = "hello"        # the rank's client ids, once at startup
    RESULT = "result"      # one client's result of a CALL
    ERROR = "error"        # a client (or the rank's startup) failed outside a sum
    BYE = "bye"            # the worker loop ended (after a STOP, or "interrupted" by Ctrl-C)
    # worker -> rank 0, per group of a SUMS (group_tags)
    RECEIPT = "receipt"    # one client's entries of its result that are not summed
    DROPPED = "dropped"    # one client dropped out of the sum, with its reason
    PARTIAL = "partial"    # the rank's sum of its clients of the group, after its last one


TAG_CMD, TAG_CMD_DATA, TAG_RESULT, TAG_DATA = 11, 12, 13, 14
# A multi-group sum's messages of group g travel under tags TAG_GROUPS + 2 g (headers) and
# TAG_GROUPS + 2 g + 1 (buffers), so that rank 0 can take one group at a time.
TAG_GROUPS = 100
CHUNK_BYTES = 2**30
_MAX_SLEEP = 0.005


def group_tags(index: int) -> tuple[int, int]:
    """(header tag, buffer tag) of group ``index``'s messages in a SUMS command."""
    return TAG_GROUPS + 2 * index, TAG_GROUPS + 2 * index + 1


def configured_chunk_bytes() -> int:
    """Largest single MPI message in bytes: ``FEDLAYER_MPI_CHUNK_BYTES`` (every rank must agree), default 2**30."""
    return int(os.environ.get("FEDLAYER_MPI_CHUNK_BYTES", CHUNK_BYTES))


class _Ref:
    """Placeholder for the i-th buffer of a message."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i

    def __reduce__(self):
        return (_Ref, (self.i,))


class Payload:
    """The raw buffers of one message, gathered while headers are flattened.

    Attributes
    ----------
    arrays : list of ndarray
        Contiguous buffers to send, in order (a packed triangle for a packed matrix).
    descs : list of (shape, dtype str, packed)
        What the receiver needs to allocate and restore each buffer; the
        header's ``"arrays"`` entry.

    An array flattened twice into one payload (the same object, e.g. the
    weights every client of a rank receives) travels once.
    """

    arrays: list[np.ndarray]
    descs: list[Desc]

    def __init__(self) -> None:
        self.arrays = []
        self.descs = []
        self._memo = {}

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers, as sent."""
        return int(sum(buffer.nbytes for buffer in self.arrays))

    def flatten(self, obj: Any, packed_keys: Sequence[str] = ()) -> Any:
        """``obj`` with every ndarray replaced by a placeholder whose buffer is appended to this payload.

        Dicts, lists and tuples are walked; other values stay in the header.
        When ``obj`` is a dict, the square matrices under its keys of
        ``packed_keys`` (at the top level only) travel as their packed upper
        triangle (d(d+1)/2 values).
        """
        if isinstance(obj, dict):
            return {k: self._flatten(v, k in packed_keys) for k, v in obj.items()}
        return self._flatten(obj, False)

    def _flatten(self, obj, pack):
        if isinstance(obj, np.ndarray):
            return self._add(obj, pack)
        if isinstance(obj, dict):
            return {k: self._flatten(v, False) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._flatten(v, False) for v in obj)
        return obj

    def _add(self, array, pack):
        key = (id(array), pack)
        if key in self._memo:
            return _Ref(self._memo[key])
        packed = pack and array.ndim == 2 and array.shape[0] == array.shape[1]
        self._memo[key] = len(self.arrays)
        self.arrays.append(pack_upper(array) if packed else np.ascontiguousarray(array))
        self.descs.append((array.shape, array.dtype.str, packed))
        return _Ref(len(self.arrays) - 1)


def inflate(skeleton: Any, arrays: Sequence[np.ndarray]) -> Any:
    """The object :meth:`Payload.flatten` flattened, its placeholders replaced by ``arrays`` (from :func:`unwire`)."""
    if isinstance(skeleton, _Ref):
        return arrays[skeleton.i]
    if isinstance(skeleton, dict):
        return {k: inflate(v, arrays) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(inflate(v, arrays) for v in skeleton)
    return skeleton


def _wire_shape(shape, packed):
    if packed:
        d = shape[0]
        return (d * (d + 1) // 2,)
    return tuple(shape)


def _chunks(buffer, chunk):
    """Byte views of ``buffer`` of at most ``chunk`` bytes (none for an empty buffer)."""
    raw = buffer.reshape(-1).view(np.uint8)
    return [raw[start:start + chunk] for start in range(0, raw.size, chunk)]


def send_buffers(comm: MPI.Comm, arrays: Sequence[np.ndarray], dest: int, tag: int, chunk: int,
                 blocking: bool) -> list[MPI.Request]:
    """Send ``arrays`` to ``dest`` in pieces of at most ``chunk`` bytes.

    Returns the Isend requests when not ``blocking`` (the arrays must then
    stay alive until they complete), else an empty list.
    """
    from mpi4py import MPI

    requests = []
    for buffer in arrays:
        for part in _chunks(buffer, chunk):
            if blocking:
                comm.Send([part, MPI.BYTE], dest=dest, tag=tag)
            else:
                requests.append(comm.Isend([part, MPI.BYTE], dest=dest, tag=tag))
    return requests


def post_receives(comm: MPI.Comm, descs: Sequence[Desc], source: int, tag: int,
                  chunk: int) -> tuple[list[np.ndarray], list[MPI.Request]]:
    """Allocate the wire buffers of a header's ``descs`` and post their Irecvs: (buffers, requests)."""
    from mpi4py import MPI

    buffers, requests = [], []
    for shape, dtype, packed in descs:
        buffer = np.empty(_wire_shape(shape, packed), dtype=np.dtype(dtype))
        buffers.append(buffer)
        for part in _chunks(buffer, chunk):
            requests.append(comm.Irecv([part, MPI.BYTE], source=source, tag=tag))
    return buffers, requests


def unwire(buffers: Sequence[np.ndarray], descs: Sequence[Desc]) -> list[npt.NDArray[Any]]:
    """The arrays of received ``buffers``: packed triangles unpacked to their (d, d) upper-triangular matrices."""
    return [unpack_upper(b, shape[0]) if packed else b for b, (shape, _, packed) in zip(buffers, descs, strict=True)]


def backoff(delay: float) -> float:
    """Sleep ``delay`` seconds while polling; returns the next delay (doubled, at most 5 ms)."""
    time.sleep(delay)
    return min(delay * 2, _MAX_SLEEP)
