"""PyTorch's own CUDA autocast test lists as an oracle for rules/ops.toml.

``torch.testing._internal.autocast_test_lists.AutocastTestLists`` is what PyTorch's
test/test_cuda.py uses to check CUDA autocast. Every entry names an op, the arguments to
call it with and (through the list it sits in) what autocast does with it. Each entry is
one test case here: the op's callable is resolved the way test_cuda.py resolves it
(``torch.X`` for the torch_* lists, ``torch._C._nn.X`` for nn_*, ``torch._C._linalg.X`` for
linalg_*, the ``Tensor`` method for methods_* and for a torch_* name torch lacks, the
entry's own module for ``banned``), called once on the CPU with the entry's arguments to
prove the callable and the arguments are the ones the oracle means, and its catalog kind
(``kind_of_callable`` for functions, ``canonical_kind`` for methods) is checked:

=============================== ============ =========================================
list                            autocast     precision
=============================== ============ =========================================
torch_fp16, nn_fp16,            ``fp16``     ``fp16``
linalg_fp16, methods_fp16
torch_fp32, nn_fp32,            ``fp32``     ``fp32``
methods_fp32
torch_need_autocast_promote     ``promote``  ``promote``
torch_/methods_expect_builtin_  ``none``     ``promote``
promote
banned                          ``banned``   ``fp32``
=============================== ============ =========================================

Decision for the builtin-promote lists: autocast does nothing with these ops because
PyTorch's type promotion already runs them in the widest input dtype, so the catalog says
``autocast = "none"`` and ``precision = "promote"``. That includes the comparisons
(eq/ne/lt/le/gt/ge, ``equal``): they compare in the promoted dtype and return bool, and
apex O1 lists them with its casts too, so they are ``promote`` rather than ``neutral``.

Entries that cannot run on the CPU (cuDNN-only ops, and einsum, whose oracle entry is
malformed: the equation sits where the argument tuple belongs and its subscripts need 4-d
operands while the entry passes 2-d ones; test_cuda.py reads the operand tuple as its
"skip on ROCm" flag and so never runs it) are still checked against the catalog through
their name, and their set is pinned so a torch upgrade that changes it is noticed. The
number of entries that do run is pinned too.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch

pytest.importorskip(
    "expecttest",
    reason="torch.testing._internal (PyTorch's autocast oracle) needs the expecttest package",
)

from ampaudit.core.catalog import builtin_catalog  # noqa: E402


def _import_oracle() -> type:
    # Importing torch.testing._internal.common_utils freezes torch.backends flags for the
    # whole process (torch.backends.disable_global_flags()); undo that so the other tests
    # in this session are unaffected.
    was_frozen = torch.backends.flags_frozen()
    from torch.testing._internal.autocast_test_lists import AutocastTestLists

    if not was_frozen:
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
    return AutocastTestLists


# list name -> (where test_cuda.py looks the op up, expected autocast, expected precision)
# A module of None means "a Tensor method"; "entry" means the entry names its module.
LISTS: dict[str, tuple[Any, str, str]] = {
    "torch_fp16": (torch, "fp16", "fp16"),
    "torch_fp32": (torch, "fp32", "fp32"),
    "torch_need_autocast_promote": (torch, "promote", "promote"),
    "torch_expect_builtin_promote": (torch, "none", "promote"),
    "nn_fp16": (torch._C._nn, "fp16", "fp16"),
    "nn_fp32": (torch._C._nn, "fp32", "fp32"),
    "linalg_fp16": (torch._C._linalg, "fp16", "fp16"),
    "methods_fp16": (None, "fp16", "fp16"),
    "methods_fp32": (None, "fp32", "fp32"),
    "methods_expect_builtin_promote": (None, "none", "promote"),
    "banned": ("entry", "banned", "fp32"),
}

# Oracle entries that raise on a CPU-only build (or that no callable answers to).
# einsum: see the module docstring. cudnn_*: cuDNN kernels exist for CUDA tensors only.
EXPECTED_NOT_RUNNABLE_ON_CPU = frozenset(
    {
        "torch_fp16:cudnn_convolution",
        "torch_fp16:cudnn_convolution_transpose",
        "torch_fp16:einsum",
    }
)

# Entries that ran on the CPU and were checked through their callable.
EXPECTED_CHECKED = 87


@dataclass(frozen=True, eq=False)  # identity hash: args hold tensors
class Case:
    list_name: str
    op: str
    args: tuple
    kwargs: dict
    module: Any  # a module, or None for a Tensor method
    autocast: str
    precision: str

    @property
    def label(self) -> str:
        return f"{self.list_name}:{self.op}"


def _case(list_name: str, entry: tuple) -> Case:
    where, autocast, precision = LISTS[list_name]
    op, args, *extra = entry
    kwargs: dict = {}
    module = None if where == "entry" else where
    for item in extra:
        if isinstance(item, dict):
            kwargs = item
        elif isinstance(item, types.ModuleType):  # banned: (op, args, module)
            module = item
        elif isinstance(item, (bool, torch.dtype)):  # ROCm skip flag / expected output dtype
            continue
        elif isinstance(args, str) and isinstance(item, tuple):  # einsum: (op, equation, operands)
            args = (args, *item)
        else:
            raise TypeError(f"unrecognised autocast oracle entry in {list_name}: {entry!r}")
    if not isinstance(args, tuple):
        args = (args,)
    return Case(list_name, op, args, kwargs, module, autocast, precision)


def _cases() -> list[Case]:
    lists = _import_oracle()(torch.device("cpu"))
    return [_case(name, entry) for name in LISTS for entry in getattr(lists, name)]


CASES = _cases()


def _ids(cases: list[Case]) -> list[str]:
    seen: dict[str, int] = {}
    ids = []
    for case in cases:
        label = f"{case.list_name}-{case.op}"
        seen[label] = seen.get(label, 0) + 1
        ids.append(label if seen[label] == 1 else f"{label}-{seen[label]}")
    return ids


def _resolve(case: Case) -> tuple[Any, bool] | None:
    """The callable test_cuda.py would use, and whether it is a Tensor method."""
    if case.module is not None and hasattr(case.module, case.op):
        return getattr(case.module, case.op), False
    if hasattr(torch.Tensor, case.op):
        return getattr(torch.Tensor, case.op), True
    return None


@cache
def _outcome(case: Case) -> str | None:
    """Run the op once on the CPU: None when it ran, else why it did not."""
    resolved = _resolve(case)
    if resolved is None:
        return "no callable"
    fn, _ = resolved
    try:
        fn(*case.args, **case.kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _kind(case: Case) -> str:
    catalog = builtin_catalog()
    resolved = _resolve(case)
    if resolved is None or _outcome(case) is not None:
        return catalog.canonical_kind(case.op)
    fn, is_method = resolved
    return catalog.canonical_kind(case.op) if is_method else catalog.kind_of_callable(fn)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_catalog_agrees_with_autocast_oracle(case: Case) -> None:
    catalog = builtin_catalog()
    kind = _kind(case)
    policy = catalog.lookup(kind)
    assert policy is not None, f"{case.label}: kind {kind!r} is missing from rules/ops.toml"
    assert policy.autocast == case.autocast, (
        f"{case.label}: ops.toml says autocast {policy.autocast!r} for {kind!r}, "
        f"PyTorch's {case.list_name} list says {case.autocast!r}"
    )
    assert policy.precision.value == case.precision, (
        f"{case.label}: precision {policy.precision.value!r} for {kind!r} is inconsistent with "
        f"{case.list_name} (expected {case.precision!r})"
    )


def test_ops_not_runnable_on_cpu_are_pinned() -> None:
    failures = {case.label: why for case in CASES if (why := _outcome(case)) is not None}
    assert set(failures) == EXPECTED_NOT_RUNNABLE_ON_CPU, failures


def test_number_of_ops_checked_through_their_callable_is_pinned() -> None:
    checked = sum(_outcome(case) is None for case in CASES)
    assert checked == EXPECTED_CHECKED
    assert checked > 80  # the oracle really ran, not a skipped or emptied list


def test_every_oracle_list_is_covered() -> None:
    lists = _import_oracle()(torch.device("cpu"))
    oracle_lists = {name for name in vars(lists) if not name.startswith("_")}
    assert oracle_lists == set(LISTS), "AutocastTestLists gained or lost a list"
    assert all(any(case.list_name == name for case in CASES) for name in LISTS)
