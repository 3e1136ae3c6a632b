"""Declarative checks of parameters and configuration values.

One style for every public entry point of ``fedlayer``: a parameter's
constraints are written once, as a list of the kinds of values it accepts,
and every failure says which parameter was wrong, what it accepts and what it
received, in the spirit of scikit-learn's ``validate_params``::

    >>> from fedlayer._validation import Interval, Options, check_param
    >>> check_param("clients", 0, [Interval(int, 1, None)])
    Traceback (most recent call last):
    ...
    ValueError: clients must be an int >= 1, got 0
    >>> check_param("dtype", "float16", [Options("float32", "float64")])
    Traceback (most recent call last):
    ...
    ValueError: dtype must be one of 'float32', 'float64', got 'float16'

A constraint list may hold :class:`Interval`, :class:`Options`,
:class:`Boolean`, :class:`InstanceOf`, :class:`ListOf` and ``None`` (the value
None is allowed); the value passes when any one of them accepts it.
:func:`check_params` checks a dict of values at once and
:func:`validate_params` decorates a function so its arguments are checked on
every call. :func:`parse_text` turns a command-line string into a value that
satisfies the constraints, for ``argparse`` types.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

__all__ = [
    "Boolean",
    "Constraint",
    "InstanceOf",
    "Interval",
    "ListOf",
    "Options",
    "check_param",
    "check_params",
    "parse_text",
    "validate_params",
]


class Constraint(Protocol):
    """What a constraint list holds besides None: a test of a value and the words for what it accepts."""

    def is_satisfied_by(self, value: Any) -> bool: ...

    def __str__(self) -> str: ...


#: A constraint list: the value passes when any one entry accepts it (``None`` accepts the value None).
Constraints = Sequence[Constraint | None]

_Function = TypeVar("_Function", bound=Callable[..., Any])


class Interval:
    """Numbers of one kind (``int`` or ``float``) between two bounds.

    Parameters
    ----------
    kind : {int, float}
        ``int`` accepts Python and NumPy integers (not bool); ``float``
        accepts any real number, integers included.
    left, right : number or None
        Bounds; None leaves that side open.
    closed : {"left", "right", "both", "neither"}, default="left"
        Which bounds belong to the interval.
    finite : bool, default=True
        Reject NaN and infinities (NaN is always rejected).
    """

    def __init__(self, kind: type, left: float | None, right: float | None, closed: str = "left",
                 finite: bool = True) -> None:
        if kind not in (int, float):
            raise TypeError(f"Interval kind must be int or float, got {kind!r}")
        if closed not in ("left", "right", "both", "neither"):
            raise ValueError(f"closed must be 'left', 'right', 'both' or 'neither', got {closed!r}")
        self.kind, self.left, self.right, self.closed, self.finite = kind, left, right, closed, finite

    def is_satisfied_by(self, value: Any) -> bool:
        """Whether ``value`` is a number of this kind within the bounds."""
        if isinstance(value, bool):
            return False
        if self.kind is int and not isinstance(value, numbers.Integral):
            return False
        if not isinstance(value, numbers.Real):
            return False
        if math.isnan(value) or (self.finite and math.isinf(value)):
            return False
        if self.left is not None:
            if value < self.left or (value == self.left and self.closed not in ("left", "both")):
                return False
        if self.right is not None:
            if value > self.right or (value == self.right and self.closed not in ("right", "both")):
                return False
        return True

    def __str__(self) -> str:
        noun = "an int" if self.kind is int else ("a finite number" if self.finite else "a number")
        left_in = self.closed in ("left", "both")
        right_in = self.closed in ("right", "both")
        if self.left is not None and self.right is not None:
            return f"{noun} in {'[' if left_in else '('}{self.left}, {self.right}{']' if right_in else ')'}"
        if self.left is not None:
            return f"{noun} {'>=' if left_in else '>'} {self.left}"
        if self.right is not None:
            return f"{noun} {'<=' if right_in else '<'} {self.right}"
        return noun


class Options:
    """One of a fixed set of values (compared with ``==``, so ``"mnist"`` but not ``"MNIST"``)."""

    def __init__(self, *values: Any) -> None:
        self.values = tuple(values)

    def is_satisfied_by(self, value: Any) -> bool:
        """Whether ``value`` is one of the options (of the first option's type)."""
        return isinstance(value, type(self.values[0])) and value in self.values

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.values)


class Boolean:
    """``True`` or ``False`` only: ``"no"``, ``0`` and ``1`` are not booleans."""

    def is_satisfied_by(self, value: Any) -> bool:
        """Whether ``value`` is True or False."""
        return isinstance(value, bool)

    def __str__(self) -> str:
        return "true or false"


class InstanceOf:
    """An instance of ``kind`` (e.g. ``str`` for a path, ``dict`` for overrides)."""

    def __init__(self, kind: type | tuple[type, ...], description: str | None = None) -> None:
        self.kind = kind
        self.description = description or f"a {kind.__name__}"

    def is_satisfied_by(self, value: Any) -> bool:
        """Whether ``value`` is an instance of ``kind`` (a bool only when ``kind`` is bool)."""
        return isinstance(value, self.kind) and not (self.kind is not bool and isinstance(value, bool))

    def __str__(self) -> str:
        return self.description


class ListOf:
    """A list (or tuple) of at least ``min_length`` items, each satisfying ``item``."""

    def __init__(self, item: Constraint, min_length: int = 1) -> None:
        self.item, self.min_length = item, min_length

    def is_satisfied_by(self, value: Any) -> bool:
        """Whether ``value`` is a list or tuple of at least ``min_length`` items that ``item`` accepts."""
        return (isinstance(value, (list, tuple)) and len(value) >= self.min_length
                and all(self.item.is_satisfied_by(v) for v in value))

    def __str__(self) -> str:
        return f"a list of {self.min_length} or more values, each {self.item}"


def _describe(constraints):
    words = ["None" if c is None else str(c) for c in constraints]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _satisfies(value, constraint):
    return value is None if constraint is None else constraint.is_satisfied_by(value)


def check_param(name: str, value: Any, constraints: Constraints) -> Any:
    """Return ``value`` if one of ``constraints`` accepts it, else raise naming ``name``.

    Parameters
    ----------
    name : str
        How the message names the parameter (an argument, a config key, a flag).
    value : object
    constraints : list
        :class:`Interval`, :class:`Options`, :class:`Boolean`,
        :class:`InstanceOf`, :class:`ListOf` objects or ``None``.

    Returns
    -------
    value : object
        Unchanged.

    Raises
    ------
    ValueError
        ``"{name} must be {what it accepts}, got {value!r}"``.
    """
    if any(_satisfies(value, c) for c in constraints):
        return value
    raise ValueError(f"{name} must be {_describe(constraints)}, got {value!r}")


def check_params(values: Mapping[str, Any], constraints: Mapping[str, Constraints],
                 where: str = "") -> Mapping[str, Any]:
    """Check every ``values[name]`` that has an entry in ``constraints``; returns ``values``.

    ``where`` (e.g. ``"config run.json: "``) prefixes the message, so an error
    in a file names the file.

    Raises
    ------
    ValueError
        As :func:`check_param`, prefixed by ``where``.
    """
    for name, allowed in constraints.items():
        if name in values:
            try:
                check_param(name, values[name], allowed)
            except ValueError as err:
                raise ValueError(f"{where}{err}") from None
    return values


def validate_params(constraints: Mapping[str, Constraints]) -> Callable[[_Function], _Function]:
    """Decorator: check the named arguments of every call against ``constraints``.

    Raises
    ------
    TypeError
        When decorating: ``constraints`` names a parameter the function does not have.

    Examples
    --------
    >>> @validate_params({"n": [Interval(int, 1, None)]})
    ... def repeat(text, n):
    ...     return text * n
    >>> repeat("ab", 2)
    'abab'
    """

    def decorate(function):
        signature = inspect.signature(function)
        unknown = set(constraints) - set(signature.parameters)
        if unknown:
            raise TypeError(f"{function.__qualname__} has no parameters {sorted(unknown)}")

        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            check_params(bound.arguments, constraints)
            return function(*args, **kwargs)

        return wrapper

    return decorate


def parse_text(text: str, constraints: Constraints) -> Any:
    """The value that command-line ``text`` denotes under ``constraints`` (for argparse types).

    A :class:`ListOf` constraint reads comma-separated items.

    Integers are tried before floats, so ``"3"`` gives ``3`` for an ``int``
    interval and ``3.0``-compatible ``3`` for a ``float`` one; ``"nan"`` and
    ``"inf"`` parse as floats and are then refused by a finite interval.

    Raises
    ------
    ValueError
        ``"must be {what it accepts}, got {text!r}"`` (argparse prefixes the flag).
    """
    for constraint in constraints:
        if constraint is None:
            continue
        if isinstance(constraint, ListOf):
            try:
                items = [parse_text(item.strip(), [constraint.item]) for item in text.split(",")] if text else []
            except ValueError:
                continue
            if constraint.is_satisfied_by(items):
                return items
            continue
        for convert in (int, float, str):
            try:
                value = convert(text)
            except ValueError:
                continue
            if constraint.is_satisfied_by(value):
                return value
    # None is not something one types: the description leaves it out.
    raise ValueError(f"must be {_describe([c for c in constraints if c is not None])}, got {text!r}")
