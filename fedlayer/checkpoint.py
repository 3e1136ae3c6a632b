"""Atomic checkpoints of the server's state after every trained layer.

A checkpoint holds what the server needs to go on where it stopped: the
groups, every finished layer's weights per group, the next batch sizes, the
first round's durations (eq. 7) and the round records so far. Weights are
stored bit for bit, with a SHA-256 digest of the whole state, so a damaged
file is refused rather than resumed from.

A personalized run also checkpoints after every personalization round: the
server's checkpoint counts the rounds done, and each client writes the layer
it personalized to a file of its own beside it (:func:`save_personal_layer`,
under ``CHECKPOINT.personal/``, on the machine where the client runs), so
that the personalized weights never reach the server. A resumed run reads
them back (:func:`load_personal_layer`) and personalizes the layers left.

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

__all__ = ["Checkpointing", "check_fingerprint", "load_checkpoint", "load_personal_layer", "personal_layer_path",
           "read_state", "save_checkpoint", "save_personal_layer", "write_state"]

_FORMAT = "fedlayer-checkpoint-2"
_PERSONAL_FORMAT = "fedlayer-personal-layer-1"
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
                    group_weights: dict, batch: dict, first_durations: dict | None, rounds: list,
                    personalized: int = 0, personal_tag: str | None = None) -> None:
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
        "personalized": personalized,
        "personal_tag": personal_tag,
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


def read_state(path: str | os.PathLike, expected_format: str, start_over: str | None = None) -> tuple[dict, dict]:
    """(state, arrays) written by :func:`write_state`, refused unless intact and of ``expected_format``.

    ``start_over`` ends every refusal's message (default: remove ``path``).

    Raises
    ------
    ValueError
        If the file is empty, truncated, damaged, not a fedlayer checkpoint
        or of another format; the message says how to start over.
    """
    start_over = _start_over(path) if start_over is None else start_over
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
        # absent from checkpoints written before personalization was checkpointed
        "personalized": state.get("personalized", 0),
        "personal_tag": state.get("personal_tag"),
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
    personalization : dict
        The settings that determine the personalized layers besides those
        (:meth:`fedlayer.run.RunConfig.personalization_fingerprint`): a run
        resumes the personalization rounds of a checkpoint only when they
        match, and personalizes anew otherwise.
    """

    path: str | Path
    fingerprint: dict = field(default_factory=dict)
    personalization: dict = field(default_factory=dict)

    def save(self, state: ServerState) -> None:
        """Write ``state`` (a :class:`fedlayer.server.ServerState`) atomically."""
        save_checkpoint(self.path, fingerprint=self.fingerprint or {}, personal_tag=self.tag, **state.fields())

    @property
    def personal_folder(self) -> Path:
        """Where each client keeps the layers it personalized (``CHECKPOINT.personal``, beside the checkpoint)."""
        path = Path(self.path)
        return path.with_name(path.stem + ".personal")

    @property
    def tag(self) -> str:
        """A digest of both fingerprints: personalized layers are read back only by a run of the same settings."""
        settings = {"fingerprint": self.fingerprint or {}, "personalization": self.personalization or {}}
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def personal_layer_path(folder: str | os.PathLike, client_id: int, position: int) -> Path:
    """The file of client ``client_id``'s personalized layer ``position`` (0-based) under ``folder``."""
    return Path(folder) / f"client{int(client_id)}_layer{int(position)}.npz"


def save_personal_layer(folder: str | os.PathLike, client_id: int, position: int, weights: np.ndarray, tag: str,
                        choice: dict | None = None) -> Path:
    """Write a client's personalized layer atomically, with the run's ``tag`` and what the client chose.

    Returns the file's path (:func:`personal_layer_path`).
    """
    path = personal_layer_path(folder, client_id, position)
    state = {"format": _PERSONAL_FORMAT, "client": int(client_id), "position": int(position), "tag": tag,
             "choice": choice}
    write_state(path, state, {"weights": weights})
    return path


def load_personal_layer(folder: str | os.PathLike, client_id: int, position: int, tag: str) -> tuple[np.ndarray, dict]:
    """(weights, choice) of :func:`save_personal_layer`, refused unless intact and written by this run.

    Raises
    ------
    ValueError
        If the file is missing, damaged, another client's or layer's, or
        written by a run of other settings; the message names the file.
    """
    path = personal_layer_path(folder, client_id, position)
    start_over = (f"remove the checkpoint these layers belong to (beside {Path(folder)}) to start over, or run "
                  f"without --resume")
    if not path.exists():
        raise ValueError(f"client {client_id}'s personalized layer {position + 1} is not at {path}: each client "
                         f"writes its layers where it runs, so resume where the run was (the same machine, or a "
                         f"folder every MPI rank sees); or {start_over}")
    state, arrays = read_state(path, _PERSONAL_FORMAT, start_over)
    if (state["client"], state["position"], state["tag"]) != (int(client_id), int(position), tag):
        raise ValueError(f"{path} holds client {state['client']}'s layer {state['position'] + 1} of the run "
                         f"{state['tag']}, not client {client_id}'s layer {position + 1} of this run ({tag}); "
                         f"{start_over}")
    return arrays["weights"], state["choice"]
