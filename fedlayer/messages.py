"""The messages between the server and its clients, named once.

A transport runs a client method by name (:class:`ClientMethod`, str-valued
so that it travels as it is and ``getattr(client, method)`` finds it) with
keyword arguments, and brings back the method's result, a dict. The records
here give those dicts a type on each side:

* requests (:class:`StatsRequest`, :class:`PersonalizeRequest`) are what the
  server asks; :meth:`kwargs` is what travels;
* replies (:class:`StatsReceipt`, :class:`EvaluateReply`,
  :class:`PersonalizeReply`) are read from what came back with ``from_result``;
* :class:`Dropout` is why a client is out of a sum: the exception's type
  name, its message and the method it raised in, or the server's own
  decision, with the protocol step the round's record names it under.

:class:`ClientProtocol` lists what a transport may call on a client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable
from collections.abc import Mapping

__all__ = ["ClientMethod", "ClientProtocol", "Dropout", "EvaluateReply", "FACTORED", "PersonalizeReply",
           "PersonalizeRequest", "StatsReceipt", "StatsRequest", "UPLOADED", "UPPER"]

#: What a client's statistics reply sends up to be summed (the rest of it is local timing).
UPLOADED = ("G", "C", "zz", "rows")
#: The summed entries that are upper-triangular (the clients never fill G's lower triangle).
UPPER = ("G",)
#: What a client's factored upload (:meth:`fedlayer.client.Client.factored_rows`) sends up to be stacked.
FACTORED = ("F", "UZ")


class ClientMethod(enum.StrEnum):
    """The client methods a server calls through a transport (the value is the method's name)."""

    LABEL_SUMMARY = "label_summary"
    LOCAL_STATS = "local_stats"
    TRAIN_ROWS = "train_rows"
    FACTORED_ROWS = "factored_rows"
    SET_WEIGHTS = "set_weights"
    PERSONALIZE = "personalize"
    EVALUATE = "evaluate"
    FINAL_WEIGHTS = "final_weights"
    SAVE_PERSONALIZED = "save_personalized"
    RESTORE_PERSONALIZED = "restore_personalized"
    SECURE_KEYS = "secure_keys"
    SECURE_NEIGHBOURS = "secure_neighbours"
    SECURE_RECEIVE = "secure_receive"
    SECURE_BOUND = "secure_bound"
    SECURE_SELF_MASK = "secure_self_mask"
    SECURE_UPLOAD = "secure_upload"
    SECURE_REVEAL = "secure_reveal"


@runtime_checkable
class ClientProtocol(Protocol):
    """What a transport may call on a client of the analytic methods (secure runs: also the ``secure_*`` steps
    of :class:`fedlayer.secure_client.SecureClient`). Every method returns a dict of arrays and numbers."""

    client_id: int

    def label_summary(self) -> dict: ...

    def local_stats(self, position: int, batch_size: int, round_index: int = 0, target_moments: bool = False,
                    coordinates: bool = False) -> dict: ...

    def train_rows(self) -> dict: ...

    def factored_rows(self, position: int, batch_size: int, round_index: int = 0,
                      coordinates: bool = False) -> dict: ...

    def set_weights(self, position: int, weights: Any) -> dict: ...

    def personalize(self, position: int, eps: float | str, batch_size: int, private: bool = False,
                    keep_in: str | None = None, tag: str | None = None) -> dict: ...

    def restore_personalized(self, positions: list[int], folder: str, tag: str) -> dict: ...

    def evaluate(self, batch_size: int = 4096, code_layer: int | None = None) -> dict: ...

    def final_weights(self) -> dict: ...

    def save_personalized(self, path: str, metadata: dict) -> dict: ...


@dataclass(frozen=True)
class Dropout:
    """Why a client is out of a sum.

    Attributes
    ----------
    message : str
        The exception's message, or the server's reason.
    error_type : str or None
        The exception's type name (``"ClientDropout"``, ``"RuntimeError"``);
        None when the server left the client out itself (a misbehaviour, a
        secure sum's rules).
    method : str or None
        The client method that raised (None for the server's decisions).
    step : str or None
        The protocol step the round's record names it under (the secure
        sum's steps); None for a failure of the round's own computation.
    """

    message: str
    error_type: str | None = None
    method: str | None = None
    step: str | None = None

    @classmethod
    def from_error(cls, err: BaseException, method: str | None = None) -> Dropout:
        """The dropout of a client whose ``method`` raised ``err``."""
        return cls(str(err), type(err).__name__, None if method is None else str(method))

    def in_step(self, step: str) -> Dropout:
        """The same dropout, recorded as one of the protocol step ``step``."""
        return Dropout(self.message, self.error_type, self.method, step)

    @property
    def kind(self) -> str:
        """What sort of failure it is: the protocol step it is recorded under, else the exception's type."""
        return self.step or self.error_type or ""

    def __str__(self) -> str:
        """The round record's text: ``"[step: ][Type: ]message"``."""
        return ": ".join(part for part in (self.step, self.error_type, self.message) if part is not None)


def _given(**kwargs) -> dict:
    """The keyword arguments set away from a client method's defaults (what travels; the same call)."""
    return {key: value for key, value in kwargs.items() if value is not None and value is not False}


@dataclass(frozen=True)
class StatsRequest:
    """The server's request for one layer's statistics (:meth:`fedlayer.client.Client.local_stats`)."""

    position: int
    batch_size: int
    round_index: int = 0
    target_moments: bool = False
    coordinates: bool = False

    def kwargs(self) -> dict:
        """The keyword arguments of ``local_stats`` (and of the secure sum's ``secure_bound``)."""
        return {"position": self.position, "batch_size": self.batch_size, "round_index": self.round_index,
                **_given(target_moments=self.target_moments, coordinates=self.coordinates)}


@dataclass(frozen=True)
class StatsReceipt:
    """A statistics reply without its summed entries (:data:`UPLOADED`): what the server sees of one client."""

    compute_s: float
    n: int | None = None
    parts: Mapping[str, float] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> StatsReceipt:
        rest = {key: value for key, value in result.items() if key not in ("compute_s", "n", "parts")}
        return cls(result["compute_s"], result.get("n"), result.get("parts"), rest)


@dataclass(frozen=True)
class PersonalizeRequest:
    """The server's request to personalize one layer (:meth:`fedlayer.client.Client.personalize`)."""

    position: int
    eps: float | str
    batch_size: int
    private: bool = False
    keep_in: str | None = None  # the folder where the client keeps the layer (a checkpointed run)
    tag: str | None = None      # the run's settings' digest, kept with the layer

    def kwargs(self) -> dict:
        return {"position": self.position, "eps": self.eps, "batch_size": self.batch_size,
                **_given(private=self.private, keep_in=self.keep_in, tag=self.tag)}


@dataclass(frozen=True)
class PersonalizeReply:
    """A client's personalization of one layer: its busy time, and what it chose unless it keeps that private."""

    compute_s: float
    parts: Mapping[str, float] | None = None
    eps: float | None = None
    method: str | None = None
    form: str | None = None

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> PersonalizeReply:
        return cls(result["compute_s"], result.get("parts"), result.get("eps"), result.get("method"),
                   result.get("form"))

    def choice(self) -> dict:
        """What the round's record keeps of the client's choice: eps and its criterion, or the solve's form."""
        if self.eps is not None:
            return {"eps": float(self.eps), "criterion": self.method}
        if self.form is not None:
            return {"form": self.form}  # the proximal solve's primal or dual form, or "kept" (eps = "inf")
        return {}


@dataclass(frozen=True)
class EvaluateReply:
    """A client's score on its local test split."""

    correct: int
    total: int

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> EvaluateReply:
        return cls(result["correct"], result["total"])
