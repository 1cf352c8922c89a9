"""``Column``: one Python number per tensor, with a tensor column's elementwise arithmetic, so
that the host runs a rule's condition once over a logged step's tensors (``verdicts.
ColumnView``) where ``HostView`` runs it once per tensor - the same Python numbers and
operations, element by element, so the same results. Torch-free.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from itertools import repeat
from typing import Any


def _binary(op: Callable[[Any, Any], Any]) -> Callable[[Column, Any], Column]:
    def apply(self: Column, other: Any) -> Column:
        return Column(map(op, self, other if isinstance(other, Column) else repeat(other)))

    return apply


def _reflected(op: Callable[[Any, Any], Any]) -> Callable[[Column, Any], Column]:
    def apply(self: Column, other: Any) -> Column:  # other is never a Column here
        return Column(map(op, repeat(other), self))

    return apply


class Column(list):
    """Elementwise ``+ - * / // % **``, comparisons, ``& | ^``, unary ``- abs``; a number on
    either side stands for every element (as a tensor broadcasts it)."""

    __hash__ = None  # a Column's == is elementwise

    __add__, __radd__ = _binary(operator.add), _reflected(operator.add)
    __sub__, __rsub__ = _binary(operator.sub), _reflected(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul), _reflected(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv), _reflected(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv), _reflected(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod), _reflected(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow), _reflected(operator.pow)
    __and__, __rand__ = _binary(operator.and_), _reflected(operator.and_)
    __or__, __ror__ = _binary(operator.or_), _reflected(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor), _reflected(operator.xor)
    __lt__, __le__ = _binary(operator.lt), _binary(operator.le)
    __gt__, __ge__ = _binary(operator.gt), _binary(operator.ge)
    __eq__, __ne__ = _binary(operator.eq), _binary(operator.ne)  # type: ignore[assignment]

    def __neg__(self) -> Column:
        return Column(map(operator.neg, self))

    def __abs__(self) -> Column:
        return Column(map(abs, self))

    def __bool__(self) -> bool:
        raise TypeError("a Column has no truth value (use & | and where(), as with a tensor)")

    # list's own + and * (concatenation, repetition) and += are replaced above; these would
    # change a column in place
    __iadd__ = __add__
    __imul__ = __mul__


def spread(value: Any, n: int) -> list:
    """``value`` as ``n`` elements: a Column's own, or a number repeated (a rule may return one)."""
    return value if isinstance(value, Column) else [value] * n


def where(cond: Column, x: Any, y: Any) -> Column:
    n = len(cond)
    return Column([a if c else b for c, a, b in zip(cond, spread(x, n), spread(y, n), strict=True)])


def maximum(x: Any, y: Any) -> Column:
    n = len(x) if isinstance(x, Column) else len(y)
    return Column(map(max, spread(x, n), spread(y, n)))


def minimum(x: Any, y: Any) -> Column:
    n = len(x) if isinstance(x, Column) else len(y)
    return Column(map(min, spread(x, n), spread(y, n)))
