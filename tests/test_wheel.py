"""The catalog and watch's C kernel source ship inside the wheel, and an installed wheel finds them."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

pytestmark = pytest.mark.slow  # builds the wheel and installs it

# The `wheel` fixture (tests/conftest.py) builds one offline with hatchling, once per session.


def test_wheel_contains_the_catalog_and_schema(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"ampaudit/_rules/ops.toml", "ampaudit/_rules/rules.toml", "ampaudit/report/report.schema.json",
            "ampaudit/watch/cpu_stats.c", "ampaudit/watch/log_text.c", "ampaudit/graph/fp8_cast.c",
            "ampaudit/core/native_simd.h"} <= names
    entry_points = zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ampaudit = ampaudit.cli.main:main" in entry_points


def test_installed_wheel_loads_its_own_catalog(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(target),
                    str(wheel)], check=True, timeout=300)
    code = ("from ampaudit.core.resources import rules_dir; from ampaudit.core.catalog import builtin_catalog; "
            "from ampaudit.watch import cpu_kernel; from ampaudit.graph import fp8_native; "
            "print(rules_dir()); print(len(builtin_catalog().ops)); print(cpu_kernel.SOURCE.is_file()); "
            "print(cpu_kernel.available() == fp8_native.available() == bool(native.compiler()))")
    code = "from ampaudit.core import native; " + code
    # a fresh cache: both C sources build from the installed wheel, their shared header found there
    env = {**os.environ, "PYTHONPATH": str(target), "AMPAUDIT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    where, count, kernel_source, built = proc.stdout.split()
    assert where == str(target / "ampaudit" / "_rules")
    assert int(count) > 100
    assert kernel_source == "True" and built == "True"
