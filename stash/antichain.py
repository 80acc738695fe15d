"""Frontiers over the total order of 64-bit signed integer times.

An :class:`Antichain` over a total order holds at most one element: ``{t}`` means
"every time >= t is still possible", and the empty antichain ``{}`` means "beyond every
time" (nothing more can happen).  Invariants kept here:

* an antichain is immutable and hashable;
* its element, when present, is an ``int`` in the i64 range;
* the partial order between antichains is the one of timely dataflow: ``a <= b`` when
  every element of ``b`` is greater than or equal to some element of ``a``; the empty
  antichain is the greatest frontier.

The idea and the names come from timely dataflow's ``Antichain`` as used by Materialize's
Stash trait (``src/stash/src/lib.rs``) and persist
(``src/persist-client/src/batch.rs``).
"""

from __future__ import annotations

from collections.abc import Iterable

I64_MIN = -(2**63)
I64_MAX = 2**63 - 1


def check_i64(value: object, what: str) -> int:
    """Return ``value`` if it is an ``int`` in the i64 range.

    Raises:
        TypeError: ``value`` is not an ``int`` (``bool`` is refused too).
        ValueError: ``value`` is outside ``[-2**63, 2**63 - 1]``.
    """
    if type(value) is int and I64_MIN <= value <= I64_MAX:  # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int (i64), got {type(value).__name__}: {value!r}")
    if not I64_MIN <= value <= I64_MAX:
        raise ValueError(f"{what} {value} is outside the i64 range")
    return value


class Antichain:
    """A frontier of i64 times: ``{t}`` or the empty frontier ``{}``.

    Construct with ``Antichain.from_elem(t)`` or ``Antichain()`` (empty), or
    ``Antichain([t1, t2, ...])`` which keeps the minimum (over a total order the
    antichain of a set of times is its least element).

    Raises:
        TypeError, ValueError: an element is not an i64 ``int``.
    """

    __slots__ = ("_elem",)

    def __init__(self, elements: Iterable[int] = ()) -> None:
        elem: int | None = None
        for e in elements:
            check_i64(e, "antichain element")
            if elem is None or e < elem:
                elem = e
        self._elem = elem

    @classmethod
    def from_elem(cls, t: int) -> Antichain:
        """The frontier ``{t}``."""
        a = object.__new__(cls)  # as cls((t,)) without the loop (a frontier per append)
        a._elem = check_i64(t, "antichain element")
        return a

    @classmethod
    def from_option(cls, t: int | None) -> Antichain:
        """``{t}`` for an int, ``{}`` for ``None`` (the inverse of :meth:`as_option`)."""
        return cls() if t is None else cls.from_elem(t)

    @property
    def elements(self) -> tuple[int, ...]:
        """The elements as a tuple: ``(t,)`` or ``()``."""
        return () if self._elem is None else (self._elem,)

    def as_option(self) -> int | None:
        """The single element, or ``None`` for the empty frontier."""
        return self._elem

    def is_empty(self) -> bool:
        """True for the empty frontier ``{}`` (beyond every time)."""
        return self._elem is None

    def less_equal(self, t: int) -> bool:
        """True if some element is ``<= t`` (time ``t`` is not yet beyond this frontier)."""
        return self._elem is not None and self._elem <= t

    def less_than(self, t: int) -> bool:
        """True if some element is ``< t``."""
        return self._elem is not None and self._elem < t

    # PartialOrder between frontiers: self <= other.
    def __le__(self, other: object) -> bool:
        if not isinstance(other, Antichain):
            return NotImplemented
        if other._elem is None:
            return True
        return self._elem is not None and self._elem <= other._elem

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Antichain):
            return NotImplemented
        return self <= other and self != other

    def __ge__(self, other: object) -> bool:
        if not isinstance(other, Antichain):
            return NotImplemented
        return other <= self

    def __gt__(self, other: object) -> bool:
        if not isinstance(other, Antichain):
            return NotImplemented
        return other < self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Antichain):
            return NotImplemented
        return self._elem == other._elem

    def __hash__(self) -> int:
        return hash(("Antichain", self._elem))

    def __str__(self) -> str:
        return "{}" if self._elem is None else "{" + str(self._elem) + "}"

    def __repr__(self) -> str:
        return f"Antichain({list(self.elements)})"

    def join(self, other: Antichain) -> Antichain:
        """The least upper bound of two frontiers (the later of the two)."""
        return self if other <= self else other

    def meet(self, other: Antichain) -> Antichain:
        """The greatest lower bound of two frontiers (the earlier of the two)."""
        return self if self <= other else other

    def to_json(self) -> list[int]:
        """JSON form: ``[t]`` or ``[]``."""
        return list(self.elements)

    @classmethod
    def from_json(cls, value: object) -> Antichain:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: ``value`` is not a list of at most one i64 int.
        """
        if not isinstance(value, list) or len(value) > 1:
            raise ValueError(f"antichain JSON must be a list of at most one int, got {value!r}")
        return cls(value)
