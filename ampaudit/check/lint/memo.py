"""Answers a helper derives from a file's facts, computed once per file.

``ScriptFacts`` is read-only, so a helper that several rules ask the same question (the AMP
state of a call's path, the models cast to fp16) keeps its answers itself: ``per_file``
memoizes a function of ``(facts, *args)`` per facts object, by identity, and drops the
answers with the facts."""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, Concatenate, ParamSpec, TypeVar
from weakref import WeakKeyDictionary

F = TypeVar("F")
P = ParamSpec("P")
R = TypeVar("R")


def per_file(compute: Callable[Concatenate[F, P], R]) -> Callable[Concatenate[F, P], R]:
    """``compute(facts, *args)``, computed once per facts and arguments (positional and
    hashable: a call, a scope)."""
    memo: WeakKeyDictionary[Any, dict[tuple[Hashable, ...], R]] = WeakKeyDictionary()

    @functools.wraps(compute)
    def once(facts: F, *args: P.args, **kwargs: P.kwargs) -> R:
        if kwargs:
            raise TypeError(f"{compute.__name__}: per-file answers are keyed by positional arguments")
        answers = memo.get(facts)
        if answers is None:
            answers = memo[facts] = {}
        if args in answers:
            return answers[args]
        answer = answers[args] = compute(facts, *args)
        return answer

    return once
