"""A registry of rule functions, shared by the graph rules and the training-script lint.

Each rule module registers one function under the codes it emits; ``run`` imports the
modules (for their registration) and calls every function once over the facts it is given.
A rule may also declare what it ``reads``: regular expressions for the source text it looks
at. The lint parses only the top-level functions and classes that match one of them, so a
new rule keyed on a new API declares its words here, in one place, with the rule.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from ampaudit.core.findings import Finding

Facts = TypeVar("Facts")
RuleFn = Callable[[Facts], Iterable[Finding]]


class RuleRegistry(Generic[Facts]):
    def __init__(self, package: str, modules: Sequence[str]) -> None:
        self.package = package
        self.modules = tuple(modules)  # one module per rule, imported on first use
        self.by_code: dict[str, RuleFn] = {}
        self.reads: dict[RuleFn, tuple[str, ...]] = {}  # rule -> source patterns it looks at
        self._loaded = False
        self._pattern: re.Pattern[str] | None = None

    def rule(self, *codes: str, reads: Sequence[str] = ()) -> Callable[[RuleFn], RuleFn]:
        def register(fn: RuleFn) -> RuleFn:
            for code in codes:
                if code in self.by_code:
                    raise RuntimeError(f"rule {code} registered twice")
                self.by_code[code] = fn
            self.reads[fn] = tuple(reads)
            self._pattern = None
            return fn

        return register

    def load(self) -> dict[str, RuleFn]:
        if not self._loaded:
            for name in self.modules:
                importlib.import_module(f"{self.package}.{name}")
            self._loaded = True
        return self.by_code

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
