"""Atomic checkpoints of the server's state after every trained layer.

A checkpoint holds what the server needs to go on where it stopped: the
groups, every finished layer's weights per group, the next batch sizes, the
first round's durations (eq. 7) and the round records so far. Weights are
stored bit for bit, with a SHA-256 digest of the whole state, so a damaged
file is refused rather than resumed from.

A resumed run repeats what an uninterrupted one computes from the same
finished layers. With fixed batch sizes (``fedacnnl-wa``, ``acnnl``) its
weights are bit for bit those of an uninterrupted run. With eq. (7) the batch
sizes of the later rounds follow measured times, which differ from run to run
(resumed or not), and so does the order of the sums: the weights then agree
to rounding, about 1e-14 relative, not bit for bit.

The file is created through :func:`tempfile.mkstemp`, so its mode is 0600
(readable by its owner only), whatever the umask.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .server import ServerState

__all__ = ["Checkpointing", "check_fingerprint", "load_checkpoint", "read_state", "save_checkpoint", "write_state"]

_FORMAT = "fedlayer-checkpoint-2"
#: Fingerprint keys added after checkpoints of this format were written, with the behaviour before them: an
#: older checkpoint, which lacks the key, matches a run with that value.
_ADDED_KEYS = {"gamma_scope": "all", "padding": "valid"}
#: Fingerprint values renamed after checkpoints of this format were written: "algorithm" used to name the run's
#: algorithm and now names the one whose federated stage it trains, which a personalized run shares.
_RENAMED_VALUES = {"algorithm": {"pfedacnnl": "pfedacnnl-wp", "pfedacnnl-wc": "fedacnnl"}}


def _digest(state_json, arrays):
    """SHA-256 of the state and of every array's name, dtype, shape and bytes."""
    digest = hashlib.sha256(state_json.encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def save_checkpoint(path: str | os.PathLike, *, fingerprint: dict, layers_done: int, group_of: dict,
                    group_weights: dict, batch: dict, first_durations: dict | None, rounds: list) -> None:
    """Write the state to ``path`` atomically (temporary file, fsync, rename)."""
    state = {
        "format": _FORMAT,
        "fingerprint": fingerprint,
        "layers_done": layers_done,
        "group_of": {str(k): v for k, v in group_of.items()},
        "batch": {str(k): v for k, v in batch.items()},
        "first_durations": None if first_durations is None else {str(k): v for k, v in first_durations.items()},
        "rounds": rounds,
        "groups": sorted(group_weights),
    }
    arrays = {f"w_{k}_{i}": W for k, weights in group_weights.items() for i, W in enumerate(weights)}
    write_state(path, state, arrays)


def write_state(path: str | os.PathLike, state: dict, arrays: dict, compress: bool = False) -> None:
    """Write a JSON-able ``state`` and named ``arrays`` to ``path`` atomically (temporary file, fsync, rename).

    The arrays are stored bit for bit with a SHA-256 digest of everything,
    which :func:`read_state` checks; ``compress`` deflates the archive.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state_json = json.dumps(state)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            (np.savez_compressed if compress else np.savez)(
                f, state=np.array(state_json), digest=np.array(_digest(state_json, arrays)), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _start_over(path):
    """How to get past a checkpoint that cannot be resumed from (the end of every refusal's message)."""
    return f"remove {path} to start over (or run without --resume, which overwrites it)"


def check_fingerprint(path: str | os.PathLike, saved: dict, fingerprint: dict) -> None:
    """Refuse to resume from ``path`` unless the ``saved`` settings equal this run's ``fingerprint``.

    The message names every setting that differs with both values, (saved, now).
    """
    fingerprint = json.loads(json.dumps(fingerprint))  # as it would be stored: tuples as JSON lists
    if saved != fingerprint:
        diff = {k: (saved.get(k), fingerprint.get(k)) for k in {**saved, **fingerprint}
                if saved.get(k) != fingerprint.get(k)}
        raise ValueError(f"checkpoint {path} was written by another configuration: (saved, now) = {diff}; "
                         f"{_start_over(path)}")


def read_state(path: str | os.PathLike, expected_format: str) -> tuple[dict, dict]:
    """(state, arrays) written by :func:`write_state`, refused unless intact and of ``expected_format``.

    Raises
    ------
    ValueError
        If the file is empty, truncated, damaged, not a fedlayer checkpoint
        or of another format; the message says how to start over.
    """
    start_over = _start_over(path)
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("it holds one array (a .npy file), not a .npz archive")
        with data:
            stored = {name: data[name] for name in data.files}
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as err:
        raise ValueError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); "
                         f"{start_over}") from None
    if "state" not in stored or "digest" not in stored:
        raise ValueError(f"{path} is not a fedlayer checkpoint (it holds {sorted(stored)}); {start_over}")
    state_json = str(stored.pop("state"))
    saved_digest = str(stored.pop("digest"))
    if _digest(state_json, stored) != saved_digest:
        raise ValueError(f"checkpoint {path} is damaged (its content does not match its SHA-256 digest); "
                         f"{start_over}")
    state = json.loads(state_json)
    if state.get("format") != expected_format:
        raise ValueError(f"{path} is not a checkpoint of this fedlayer version (format {state.get('format')!r}, "
                         f"expected {expected_format!r}); {start_over}")
    return state, stored


def load_checkpoint(path: str | os.PathLike, fingerprint: dict) -> dict:
    """The state saved by :func:`save_checkpoint`, checked against this run's fingerprint.

    Raises
    ------
    ValueError
        If the file is empty, truncated, damaged, not a fedlayer checkpoint,
        or written by another configuration; the message says how to start
        over.
    """
    state, stored = read_state(path, _FORMAT)
    saved = {**_ADDED_KEYS, **state["fingerprint"]}
    saved.update({key: renamed.get(saved[key], saved[key]) for key, renamed in _RENAMED_VALUES.items() if key in saved})
    check_fingerprint(path, saved, {**_ADDED_KEYS, **fingerprint})
    group_weights = {int(k): [stored[f"w_{k}_{i}"] for i in range(state["layers_done"])] for k in state["groups"]}
    return {
        "layers_done": state["layers_done"],
        "group_of": {int(k): v for k, v in state["group_of"].items()},
        "batch": {int(k): v for k, v in state["batch"].items()},
        "first_durations": None if state["first_durations"] is None
        else {int(k): v for k, v in state["first_durations"].items()},
        "rounds": state["rounds"],
        "group_weights": group_weights,
    }


@dataclass(frozen=True)
class Checkpointing:
    """Where a run writes its server's state after every trained layer, and the settings it is checked against.

    Attributes
    ----------
    path : path
    fingerprint : dict
        The run's settings that determine the trained weights
        (:meth:`fedlayer.run.RunConfig.fingerprint`).
    """

    path: str | Path
    fingerprint: dict = field(default_factory=dict)

    def save(self, state: ServerState) -> None:
        """Write ``state`` (a :class:`fedlayer.server.ServerState`) atomically."""
        save_checkpoint(self.path, fingerprint=self.fingerprint or {}, **state.fields())
