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

The arguments are used as given, outside autocast. Entries that raise on the CPU are still
checked against the catalog (through the callable, or the name where none exists), and
their set is pinned so that a torch upgrade changing it is noticed; the number of entries
that do run is pinned too. They raise for four reasons:

* cuDNN-only ops (cudnn_convolution, cudnn_convolution_transpose);
* the torch_need_autocast_promote entries mix fp16 and fp32 inputs on purpose: these ops
  have no built-in type promotion and reject mixed dtypes, which is why autocast promotes
  them (only atan2, addcdiv and addcmul promote on their own);
* fp16 CPU kernels that do not exist (pdist, cdist, multilabel_margin_loss,
  multi_margin_loss);
* einsum, whose oracle entry is malformed: the equation sits where the argument tuple
  belongs and its subscripts need 4-d operands while the entry passes 2-d ones
  (test_cuda.py reads the operand tuple as its "skip on ROCm" flag and never runs it).
"""

from __future__ import annotations

import types
import warnings
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import torch

pytest.importorskip(
    "expecttest",
    reason="torch.testing._internal (PyTorch's autocast oracle) needs the expecttest package",
)

from ampaudit.core.catalog import builtin_catalog


def _import_oracle() -> type:
    # Importing torch.testing._internal.common_utils freezes torch.backends flags for the
    # whole process (torch.backends.disable_global_flags()); undo that so the other tests
    # in this session are unaffected.
    was_frozen = torch.backends.flags_frozen()
    from torch.testing._internal.autocast_test_lists import AutocastTestLists

    if not was_frozen:
        # torch.backends is a wrapper module: the flag lives in its functions' globals.
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
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

# Oracle entries (by test id) that raise on a CPU-only build; see the module docstring.
EXPECTED_NOT_RUNNABLE_ON_CPU = frozenset(
    {
        "torch_fp16-cudnn_convolution",
        "torch_fp16-cudnn_convolution_transpose",
        "torch_fp16-einsum",
        "torch_fp32-pdist",
        "torch_fp32-cdist",
        "torch_need_autocast_promote-bilinear",
        "torch_need_autocast_promote-cross",
        "torch_need_autocast_promote-dot",
        "torch_need_autocast_promote-vdot",
        "torch_need_autocast_promote-grid_sampler",
        "torch_need_autocast_promote-index_put",
        "torch_need_autocast_promote-index_put-2",
        "torch_need_autocast_promote-tensordot",
        "torch_need_autocast_promote-scatter_add",
        "torch_need_autocast_promote-scatter_add-2",
        "nn_fp32-multilabel_margin_loss",
        "nn_fp32-multi_margin_loss",
    }
)

# Oracle entries in all, and those that ran on the CPU.
EXPECTED_ENTRIES = 121
EXPECTED_RAN = 104


@dataclass(frozen=True, eq=False)  # identity hash: args hold tensors
class Case:
    id: str  # the test id: list-op, with -2, -3... for an op the list names again
    list_name: str
    op: str
    args: tuple
    kwargs: dict
    module: Any  # a module, or None for a Tensor method
    autocast: str
    precision: str


def _case(list_name: str, entry: tuple, case_id: str) -> Case:
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
    return Case(case_id, list_name, op, args, kwargs, module, autocast, precision)


def _cases() -> list[Case]:
    lists = _import_oracle()(torch.device("cpu"))
    cases = []
    seen: dict[str, int] = {}
    for name in LISTS:
        for entry in getattr(lists, name):
            label = f"{name}-{entry[0]}"
            seen[label] = seen.get(label, 0) + 1
            cases.append(_case(name, entry, label if seen[label] == 1 else f"{label}-{seen[label]}"))
    return cases


CASES = _cases()


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
        with warnings.catch_warnings():  # deprecation notes (chain_matmul, cross without dim)
            warnings.simplefilter("ignore")
            fn(*case.args, **case.kwargs)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _kind(case: Case) -> str:
    catalog = builtin_catalog()
    resolved = _resolve(case)
    if resolved is None or resolved[1]:  # a Tensor method: by name, as fx and aten spell it
        return catalog.canonical_kind(case.op)
    return catalog.kind_of_callable(resolved[0])


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_catalog_agrees_with_autocast_oracle(case: Case) -> None:
    catalog = builtin_catalog()
    kind = _kind(case)
    policy = catalog.lookup(kind)
    assert policy is not None, f"{case.id}: kind {kind!r} is missing from rules/ops.toml"
    assert policy.autocast == case.autocast, (
        f"{case.id}: ops.toml says autocast {policy.autocast!r} for {kind!r}, "
        f"PyTorch's {case.list_name} list says {case.autocast!r}"
    )
    assert policy.precision.value == case.precision, (
        f"{case.id}: precision {policy.precision.value!r} for {kind!r} is inconsistent with "
        f"{case.list_name} (expected {case.precision!r})"
    )


def test_ops_not_runnable_on_cpu_are_pinned() -> None:
    failures = {case.id: why for case in CASES if (why := _outcome(case)) is not None}
    assert set(failures) == EXPECTED_NOT_RUNNABLE_ON_CPU, failures


def test_number_of_oracle_entries_checked_is_pinned() -> None:
    ran = sum(_outcome(case) is None for case in CASES)
    assert (len(CASES), ran) == (EXPECTED_ENTRIES, EXPECTED_RAN)
    assert ran > 100  # the oracle really ran, not a skipped or emptied list


def test_every_oracle_list_is_covered() -> None:
    lists = _import_oracle()(torch.device("cpu"))
    oracle_lists = {name for name in vars(lists) if not name.startswith("_")}
    assert oracle_lists == set(LISTS), "AutocastTestLists gained or lost a list"
    assert all(any(case.list_name == name for case in CASES) for name in LISTS)
