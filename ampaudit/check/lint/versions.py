"""Code chosen by the installed torch's version: the tests a fallback for old torch sits under,
the names that hold such a test, and whether a file shows it runs on older torch.

What is recognised (spelling only: the lint imports nothing):

- a test that reads a version - ``version.parse(torch.__version__) < ...``,
  ``compare_version("torch", ...)``, ``is_torch_version(">=", "2.4")``, ``TORCH_VERSION``, any
  text with "version" in it -, or asks ``hasattr(torch...)``, or names a torch requirement
  (``RequirementCache("torch>=2.4")``);
- a name spelled as a torch version flag: ``torch_``, a comparison word (greater, less, ge, gt,
  le, lt, eq, at_least, newer, older, is) and a version number - ``_TORCH_GREATER_EQUAL_2_4``
  (Lightning), ``TORCH_GE_2_4``, ``is_torch_less_than_1_11`` -, ``TORCH_2_4``, or a call
  ``is_torch_greater_or_equal("2.4")``: imported or not, read anywhere in the test;
- a name the file assigns from a torch version test (``TORCH_VALUE``):
  ``_NEW_AMP = Version(torch.__version__) >= Version("2.4")`` and ``if _NEW_AMP:`` (visit.py).
"""

from __future__ import annotations

import re

from ampaudit.check.lint.facts import ScriptFacts
from ampaudit.check.lint.memo import per_file

# `_TORCH_GREATER_EQUAL_2_4`, `TORCH_GE_2_4`, `is_torch_less_than_1_11`, `TORCH_2_4`,
# `is_torch_greater_or_equal(`: a version number (or a call) keeps `torch_is_available` and the
# like out
_FLAG = (r"(?<![a-z0-9])torch_(?:(?:greater|less|ge|gt|le|lt|eq|at_least|newer|older|is)(?:_[a-z]+)*_v?\d"
         r"|\d|(?:greater|less)\w*\()")
# `RequirementCache("torch>=2.4")`, `"torch<2.3"`
_REQUIREMENT = r"""["']torch\s*(?:[<>=!~]=?|===)"""

# the test of an `if`, `elif` or conditional expression that picks code by the torch version
VERSION_TEST = re.compile(rf"version|TORCH_\d|hasattr\(\s*torch|{_FLAG}|{_REQUIREMENT}", re.IGNORECASE)

# a value that is a torch version test, stricter than VERSION_TEST (any "version" is not
# torch's: `use_v2 = args.version == 2`): assigned to a name, it makes that name a version
# flag; anywhere in a file, it shows the file runs on older torch too
TORCH_VALUE = re.compile(
    rf"""torch\.(?:version\.)?__version__|torch_?version|version\w*\(\s*["']torch["']|hasattr\(\s*torch\b"""
    rf"|{_FLAG}|{_REQUIREMENT}", re.IGNORECASE)


@per_file
def supports_old_torch(facts: ScriptFacts) -> bool:
    """The file shows it runs on a torch older than the one it is linted for: it tests the torch
    version somewhere (``TORCH_VALUE``), or keeps a deprecated AMP API as a fallback
    (``try``/``except ImportError``, a version branch). A rewrite to an API newer torch added
    (``torch.amp.GradScaler``: 2.3) may break it there."""
    if TORCH_VALUE.search(facts.source) is not None:
        return True
    return any(i.compat and i.module.startswith(_OLD) for i in facts.imports) or any(
        use.compat and any(n.startswith(_OLD) for n in use.names) for use in (*facts.calls, *facts.amp_references))


_OLD = ("torch.cuda.amp", "torch.cpu.amp")
