"""The server's state between rounds: exactly what a checkpoint holds."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

__all__ = ["ServerState", "shareable"]


def shareable(W: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
    """W contiguous in ``dtype`` and read-only: clients in this process share it instead of copying it."""
    W = np.ascontiguousarray(W, dtype=dtype)
    W.flags.writeable = False
    return W


@dataclass
class ServerState:
    """What the server knows after each stage; the stages of :mod:`fedlayer.server.stages` read and update it.

    Attributes
    ----------
    group_of : dict cid -> int
        Each client's group (0..K-1).
    batch : dict cid -> int
        Each client's batch size in the next federated round (eq. 7).
    first_durations : dict cid -> float or None
        Each client's busy time in the first federated round (None before it).
    group_weights : dict group -> list of ndarray
        Every finished layer's weights per group, read-only.
    rounds : list of dict
        The round records so far (:class:`fedlayer.timing.RoundLog`).
    layers_done : int
        Federated rounds finished.
    personalized : int
        Personalization rounds finished (each client keeps its personalized
        layers on its side, :func:`fedlayer.checkpoint.save_personal_layer`).
    """

    group_of: dict[int, int]
    batch: dict[int, int]
    first_durations: dict[int, float] | None = None
    group_weights: dict[int, list[np.ndarray]] = field(default_factory=dict)
    rounds: list[dict] = field(default_factory=list)
    layers_done: int = 0
    personalized: int = 0

    @property
    def n_groups(self) -> int:
        return max(self.group_of.values()) + 1

    def install(self, k: int, W: np.ndarray, dtype: npt.DTypeLike) -> np.ndarray:
        """Append group ``k``'s next layer (kept shareable in ``dtype``); returns the kept array."""
        kept = shareable(W, dtype)
        self.group_weights[k].append(kept)
        return kept

    def fields(self) -> dict[str, Any]:
        """The state as the keyword arguments of :func:`fedlayer.checkpoint.save_checkpoint`."""
        return {"layers_done": self.layers_done, "group_of": self.group_of, "group_weights": self.group_weights,
                "batch": self.batch, "first_durations": self.first_durations, "rounds": self.rounds,
                "personalized": self.personalized}

    @classmethod
    def from_checkpoint(cls, saved: Mapping[str, Any], weights_dtype: npt.DTypeLike | None = None) -> ServerState:
        """The state of :func:`fedlayer.checkpoint.load_checkpoint`'s dict, weights shareable in ``weights_dtype``
        (None: as stored)."""
        weights = {int(k): [shareable(W, W.dtype if weights_dtype is None else weights_dtype) for W in layers]
                   for k, layers in saved["group_weights"].items()}
        return cls(group_of=dict(saved["group_of"]), batch=dict(saved["batch"]),
                   first_durations=None if saved["first_durations"] is None else dict(saved["first_durations"]),
                   group_weights=weights, rounds=list(saved["rounds"]), layers_done=int(saved["layers_done"]),
                   personalized=int(saved.get("personalized", 0)))

    def without_personalization(self) -> ServerState:
        """This state before its personalization rounds: what a run that does not personalize resumes from."""
        rounds = [r for r in self.rounds if r.get("stage") != "personalization"]
        return dataclasses.replace(self, rounds=rounds, personalized=0)
