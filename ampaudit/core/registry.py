"""Registries of rules by code, shared by the graph rules, the training-script lint and
watch's runtime rules.

``CodeRegistry``: what each rule module registers under the codes it emits, its modules
imported on first lookup. ``RuleRegistry`` holds rule functions: ``run`` calls every one
once over the facts it is given. A rule may also declare what it ``reads``: regular
expressions for the source text it looks at. The lint parses only the top-level functions
and classes that match one of them, so a new rule keyed on a new API declares its words
here, in one place, with the rule.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from ampaudit.core.findings import Finding

Facts = TypeVar("Facts")
Item = TypeVar("Item")
RuleFn = Callable[[Facts], Iterable[Finding]]


class CodeRegistry(Generic[Item]):
    """Items registered under rule codes by the modules of ``package``, imported on first use."""

    def __init__(self, package: str, modules: Sequence[str]) -> None:
        self.package = package
        self.modules = tuple(modules)  # one module per rule (or per family), imported on first use
        self.by_code: dict[str, Item] = {}
        self._loaded = False

    def add(self, item: Item, *codes: str) -> Item:
        for code in codes:
            if code in self.by_code:
                raise RuntimeError(f"rule {code} registered twice")
        self.by_code.update(dict.fromkeys(codes, item))
        return item

    def load(self) -> dict[str, Item]:
        if not self._loaded:
            for name in self.modules:
                importlib.import_module(f"{self.package}.{name}")
            self._loaded = True
        return self.by_code


class RuleRegistry(CodeRegistry[RuleFn], Generic[Facts]):
    """Rule functions by code, and the source text each reads."""

    def __init__(self, package: str, modules: Sequence[str]) -> None:
        super().__init__(package, modules)
        self.reads: dict[RuleFn, tuple[str, ...]] = {}  # rule -> source patterns it looks at
        self._pattern: re.Pattern[str] | None = None

    def rule(self, *codes: str, reads: Sequence[str] = ()) -> Callable[[RuleFn], RuleFn]:
        def register(fn: RuleFn) -> RuleFn:
            self.add(fn, *codes)
            self.reads[fn] = tuple(reads)
            self._pattern = None
            return fn

        return register

    def read_pattern(self) -> re.Pattern[str]:
        """One regex matching any text some registered rule reads."""
        self.load()
        if self._pattern is None:
            words = dict.fromkeys(word for fn in self.reads.values() for word in fn)  # ordered, deduplicated
            self._pattern = re.compile("|".join(words))
        return self._pattern

    def run(self, facts: Facts) -> list[Finding]:
        functions = dict.fromkeys(self.load().values())  # each function once, in registration order
        return [finding for rule in functions for finding in rule(facts)]
