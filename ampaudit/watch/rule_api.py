"""What a runtime rule (AMP6xx) is written against. Each rule is one unit in
``runtime_rules.py``, registered with ``@runtime_rule("AMP6nn")``; its thresholds are
``[AMP6nn.params]`` of rules/rules.toml (``self.params``), its fixes ``[AMP6nn.hints]``.

A ``ModuleRule``'s condition is written once and runs in two places: over a log record's
Stats on the host (``verdicts.py``, where each column is a Python number, or a ``Column`` of
them, one per tensor of the step) and over a step's
Stats rows on the device (``conditions.py``, where each column is a tensor with one element
per module, so a Monitor without a log never reads them back per step). So a condition is
plain arithmetic and comparisons (``+ - * / < <= == >= >``), ``&`` and ``|`` for and/or (in
parentheses: they bind tighter than comparisons) and ``where``, ``maximum``, ``minimum`` -
never ``and``/``or``/``not``/``if`` or ``~``: a tensor has no truth value, and ``~True`` is -2.

- ``LayerRule``: per module and phase, over the module's output (or output gradient).
- ``GradientRule``: per module, over its parameters' gradients: ``measure`` each tensor,
  the sums per module judged by ``condition``. ``measure`` may read sums over all the
  step's gradients (``step_sums``, as ``Step.sums``).

The engines keep one ``Row`` per (rule, module, phase) however long the run - the first and
last step the condition held, in how many, its longest run of consecutive logged steps and
the sums of what it measured - and the rule's ``report`` turns its rows into findings.

A ``StepRule`` judges the loss scale and skip of each logged step: numbers the host reads
every step anyway, so its condition runs there only, keeping its own constant-size state.
An ``Fp8Rule`` (AMP75x) judges the float8 rows of a step watched with ``fp8=True``
(``watch/fp8.py``), read back with the step: on the host too, with its own state.

Torch-free: ``ampaudit report`` runs the rules without importing torch.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, TypeVar

from ampaudit.core.dtypes import LowDtype
from ampaudit.core.listing import listed
from ampaudit.core.registry import CodeRegistry
from ampaudit.core.rulebook import rule
from ampaudit.watch import columns
from ampaudit.watch.columns import Column
from ampaudit.watch.stats_merge import FIELDS

Value = Any  # a Python number or bool (a log's step), a Column of them (a log's step at once), or a tensor column
GRADIENTS = "grad"  # the phase of a GradientRule's rows: a module's parameter gradients


# -- what a condition reads --------------------------------------------------------------------

class StatsView(ABC):
    """The Stats of the tensors a condition judges: each field (``layout.FIELDS``) is a
    column - one number on the host, one element per tensor on the device."""

    numel: Value
    nan: Value
    inf: Value
    neginf: Value
    overflow: Value
    underflow: Value
    zero: Value
    absmax: Value

    def __getattr__(self, name: str) -> Value:
        if name in FIELDS:
            return self.field(name)
        raise AttributeError(name)

    @abstractmethod
    def field(self, name: str) -> Value:
        """The column of Stats field ``name``."""

    @property
    @abstractmethod
    def nonzero(self) -> Value:
        """The finite nonzero values (the histogram's count)."""

    @abstractmethod
    def below(self, limit: float, scale: Value | None) -> Value:
        """The finite values whose magnitude bin [2^e, 2^(e+1)), multiplied by ``scale`` (None:
        1), lies wholly below ``limit`` - exact, as the bins are powers of two."""

    @abstractmethod
    def in_phase(self, phase: str) -> Value:
        """Whether each tensor is of ``phase`` ("forward", "backward", ``GRADIENTS``)."""


@dataclass(frozen=True)
class Step:
    """One logged step, as a condition sees it."""

    limits: LowDtype  # the audited dtype
    scale: Value | None  # the loss scale its backward ran with; None without a GradScaler
    # by name only (two optional fields of unlike kinds: a positional one would land in the other)
    sums: tuple[Value, ...] = field(default=(), kw_only=True)  # a GradientRule's ``step_sums`` over all parameters
    skipped: Value = field(default=False, kw_only=True)  # the GradScaler skipped it: its gradients never applied

    @property
    def scaled(self) -> bool:
        return self.scale is not None


def _python(*values: Value) -> bool:
    return all(isinstance(v, (bool, int, float)) for v in values)


def where(cond: Value, x: Value, y: Value) -> Value:
    """``x`` where ``cond`` holds, else ``y``."""
    if isinstance(cond, Column):
        return columns.where(cond, x, y)
    if _python(cond):
        return x if cond else y
    import torch  # only a tensor column gets here: torch is loaded

    return torch.where(cond, x, y)


def maximum(x: Value, y: Value) -> Value:
    if isinstance(x, Column) or isinstance(y, Column):
        return columns.maximum(x, y)
    if _python(x, y):
        return max(x, y)
    if _python(x):
        x, y = y, x
    return x.clamp(min=y) if _python(y) else x.maximum(y)


def minimum(x: Value, y: Value) -> Value:
    if isinstance(x, Column) or isinstance(y, Column):
        return columns.minimum(x, y)
    if _python(x, y):
        return min(x, y)
    if _python(x):
        x, y = y, x
    return x.clamp(max=y) if _python(y) else x.minimum(y)


class Condition(NamedTuple):
    """What a condition returns for each module: whether it holds, and two numbers its row
    sums over the steps it held in (keeping the largest ``value`` too)."""

    holds: Value
    value: Value
    total: Value


# -- what a report reads -----------------------------------------------------------------------

class Row(NamedTuple):
    """One (rule, module, phase)'s steps: -1 in the first five before any step held."""

    first: float  # the first logged step the condition held
    last: float
    run_start: float  # the current run of consecutive logged steps
    best_start: float  # the longest run
    best_last: float
    count: float  # logged steps it held in
    seen: float  # logged steps the module was measured in
    run_len: float
    best_len: float
    sum_value: float  # Condition.value, summed over the steps it held in
    sum_total: float
    peak: float  # the largest Condition.value


COLUMNS = Row._fields
UNSET = 5  # the first UNSET columns start at -1, the others at 0
(FIRST, LAST, RUN_START, BEST_START, BEST_LAST, COUNT, SEEN, RUN_LEN, BEST_LEN, SUM_VALUE, SUM_TOTAL,
 PEAK) = range(len(COLUMNS))


@dataclass
class Run:
    """What the reports know of the whole run."""

    limits: LowDtype
    scaled: bool  # a logged step ran with a loss scale
    first_scaled: int | None  # the first such step
    params: dict[str, set[str]]  # module -> its parameters seen with gradients
    first_nonfinite: dict[str, Any] | None  # the summary's first non-finite value
    nonfinite: Counter = field(default_factory=Counter)  # parameters non-finite on skipped steps
    # whether the run computes in the audited dtype: False where none was seen (an fp32 run
    # audited for float16 by default), None where the dtype was given and the run's is unknown
    computes_low: bool | None = None
    skipped: int = 0  # logged steps the GradScaler skipped
    # each logged step's own first non-finite (module, phase), as (step, module, phase) where it
    # differs from the logged step before's (module None: none, or no longer known: ``FIRSTS_KEPT``)
    firsts: tuple[tuple[int, str | None, str | None], ...] = ()

    def first_at(self, step: float) -> tuple[str, str] | None:
        """The (module, phase) logged step ``step`` first went non-finite in, where known."""
        i = bisect.bisect_right(self.firsts, step, key=lambda change: change[0]) - 1
        if i < 0 or self.firsts[i][1] is None:
            return None
        _, module, phase = self.firsts[i]
        return module, phase or ""


FIRSTS_KEPT = 4096  # Run.firsts' changes kept: a run that flips more often than that is not told apart


@dataclass(frozen=True)
class ScaleStep:
    """One logged step, as a StepRule sees it."""

    step: int
    scale: float | None  # the loss scale it used; None without a GradScaler
    skipped: bool
    nonfinite: list[str]  # the parameters whose gradients were non-finite, on a skipped step
    peak: tuple[float, int] | None  # the highest scale an earlier step was applied with, and that step


@dataclass(frozen=True)
class Verdict:
    """One finding of a rule: its message fields as rules.toml's template names them."""

    first: float  # the step it starts at: findings sort by rule, then this, then module
    module: str | None
    fix: str | None
    fields: dict[str, Any]


# -- the rules ---------------------------------------------------------------------------------

class RuntimeRule:
    code: ClassVar[str] = ""  # set by @runtime_rule

    def __init__(self) -> None:
        info = rule(self.code)
        self.params, self.hints = info.params, info.hints


class ModuleRule(RuntimeRule, ABC):
    phases: ClassVar[tuple[str, ...]]

    @abstractmethod
    def report(self, rows: dict[tuple[str, str], Row], run: Run) -> Iterable[Verdict]:
        """The findings, from each (module, phase)'s row."""


class LayerRule(ModuleRule):
    phases: ClassVar[tuple[str, ...]] = ("forward",)  # the rows it judges

    @abstractmethod
    def condition(self, s: StatsView, step: Step) -> Condition:
        """Per module, over its output's (or output gradient's) Stats in one of ``phases``."""


class GradientRule(ModuleRule):
    phases: ClassVar[tuple[str, ...]] = (GRADIENTS,)

    def step_sums(self, s: StatsView, step: Step) -> tuple[Value, ...]:
        """Per parameter gradient: numbers summed over all the step's parameters, that
        ``measure`` reads as ``step.sums`` (what the rest of the step's gradients say about
        one tensor); none by default."""
        return ()

    @abstractmethod
    def measure(self, s: StatsView, step: Step) -> tuple[Value, Value]:
        """Per parameter gradient: two numbers, summed over each module's parameters."""

    @abstractmethod
    def condition(self, value: Value, total: Value, step: Step) -> Value:
        """Per module, over those sums: whether it holds."""


class StepRule(RuntimeRule, ABC):
    @abstractmethod
    def observe(self, step: ScaleStep) -> None:
        """One logged step, in order."""

    @abstractmethod
    def report(self, run: Run) -> Iterable[Verdict]:
        """The findings, from the state ``observe`` kept."""


@dataclass(frozen=True)
class Fp8Rows:
    """One logged step's float8 rows, as an Fp8Rule sees them (``layout.FP8_FIELDS``)."""

    step: int
    prev: int  # the logged step before (-1: none): a run of steps is consecutive logged steps
    modules: dict[str, dict[str, Any]]  # module -> {"kind": ..., operand: {"format", field: value}}

    def operands(self) -> Iterable[tuple[str, str, dict[str, Any]]]:
        """(module, operand, row) for each operand measured in the step."""
        for module, entry in self.modules.items():
            for operand, row in entry.items():
                if isinstance(row, dict):
                    yield module, operand, row


class Fp8Rule(RuntimeRule, ABC):
    @abstractmethod
    def observe(self, rows: Fp8Rows) -> None:
        """One logged step's float8 rows, in order."""

    @abstractmethod
    def report(self, run: Run) -> Iterable[Verdict]:
        """The findings, from the state ``observe`` kept."""


REGISTRY: CodeRegistry[type[RuntimeRule]] = CodeRegistry("ampaudit.watch", ("runtime_rules",))
R = TypeVar("R", bound=type[RuntimeRule])


def runtime_rule(code: str) -> Callable[[R], R]:
    """Register a runtime rule's class under ``code``."""
    def register(cls: R) -> R:
        cls.code = code
        return REGISTRY.add(cls, code)

    return register


def rule_units() -> dict[str, RuntimeRule]:
    """A fresh instance of every registered rule, by code: each run keeps its own state."""
    return {code: cls() for code, cls in sorted(REGISTRY.load().items())}


# -- words for the messages --------------------------------------------------------------------

def owner(param: str) -> str:
    """The module a parameter belongs to: ``blocks.0.fc.weight`` -> ``blocks.0.fc``."""
    return param.rpartition(".")[0] or "(model)"


def steps_text(row: Row) -> str:
    if row.count == 1:
        return f"at step {int(row.first)}"
    return f"in {int(row.count)} logged steps from {int(row.first)} to {int(row.last)}"


def scale_text(value: float) -> str:
    """A loss scale: a large or small power of two as one (2**40), else as a number."""
    mantissa, exponent = math.frexp(value)
    if mantissa == 0.5 and abs(exponent - 1) >= 10:
        return f"2**{exponent - 1}"
    return f"{value:g}"


def percent(share: float) -> str:
    text = f"{100 * share:.1f}%"
    return text.replace(".0%", "%")


def names(items: list[str], most: int = 4) -> str:
    return listed(items, most)
