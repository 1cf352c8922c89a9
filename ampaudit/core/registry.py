"""A registry of rule functions, shared by the graph rules and the training-script lint.

Each rule module registers one function under the codes it emits; ``run`` imports the
modules (for their registration) and calls every function once over the facts it is given.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, TypeVar

from ampaudit.core.findings import Finding

Facts = TypeVar("Facts")
Rule = Callable[[Facts], Iterable[Finding]]


class RuleRegistry(Generic[Facts]):
    def __init__(self, package: str, modules: Sequence[str]) -> None:
        self.package = package
        self.modules = tuple(modules)  # one module per rule, imported on first use
        self.by_code: dict[str, Rule] = {}
        self._loaded = False

    def rule(self, *codes: str) -> Callable[[Rule], Rule]:
        def register(fn: Rule) -> Rule:
            for code in codes:
                if code in self.by_code:
                    raise RuntimeError(f"rule {code} registered twice")
                self.by_code[code] = fn
            return fn

        return register

    def load(self) -> dict[str, Rule]:
        if not self._loaded:
            for name in self.modules:
                importlib.import_module(f"{self.package}.{name}")
            self._loaded = True
        return self.by_code

    def run(self, facts: Facts) -> list[Finding]:
        functions = dict.fromkeys(self.load().values())  # each function once, in registration order
        return [finding for rule in functions for finding in rule(facts)]
