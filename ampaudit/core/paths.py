"""How files are named in reports: relative to the working directory when inside it."""

from __future__ import annotations

import os
from functools import lru_cache


@lru_cache(maxsize=4096)
def display_path(file: str) -> str:
    if file.startswith("<"):
        return file
    try:
        rel = os.path.relpath(file)
    except ValueError:  # another drive on Windows
        return file
    return file if rel.startswith(os.pardir + os.sep) or rel == os.pardir else rel
