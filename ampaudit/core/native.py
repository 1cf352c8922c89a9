"""ampaudit's C sources, compiled on first use with the system C compiler and loaded with ctypes.

One C file per job (``watch/cpu_stats.c``: watch's statistics rows; ``watch/log_text.c``: a
logged step's rows as its log line's text; ``graph/fp8_cast.c``: fp8 casts emulated in one
pass). Each is compiled with ``$CC`` (else cc/gcc/clang), with OpenMP where the compiler has
it, into a cache directory keyed by the source, its defines and the machine - a fraction of a
second, once per machine - and every caller falls back to torch ops (or, for the log line, to
``json``) where no compiler is around or ``AMPAUDIT_CPU_KERNEL=0`` is set.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

DISABLE = "AMPAUDIT_CPU_KERNEL"  # "0": torch ops only


@lru_cache(maxsize=16)
def float_bits(value: float) -> int:
    """The fp32 bits of ``value``, as a kernel takes a threshold: for values >= 0 the bits'
    order is the floats' order."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def disabled() -> bool:
    return os.environ.get(DISABLE, "1") == "0"


def cache_dir() -> Path:
    """$AMPAUDIT_CACHE_DIR, else $XDG_CACHE_HOME/ampaudit, else ~/.cache/ampaudit."""
    if os.environ.get("AMPAUDIT_CACHE_DIR"):
        return Path(os.environ["AMPAUDIT_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ampaudit"


def build_dir() -> Path:
    """Where builds go: ``cache_dir()`` - or, where that cannot be made or written (a HOME that
    is not writable: a container run as a user of no home, ``setpriv --reuid``), a folder of this
    user's own in the temporary folder, which the kernels were silently not built without (watch
    took the torch ops, slower). That folder is used only if it is this user's and closed to
    others: a library is loaded from it."""
    primary = cache_dir()
    if os.environ.get("AMPAUDIT_CACHE_DIR") or not hasattr(os, "getuid"):
        return primary
    try:
        primary.mkdir(parents=True, exist_ok=True)
        if os.access(primary, os.W_OK | os.X_OK):
            return primary
    except OSError:
        pass
    own = Path(tempfile.gettempdir()) / f"ampaudit-{os.getuid()}"
    try:
        os.mkdir(own, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return primary
    info = os.lstat(own)
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
        return own
    return primary  # another user's, a link, or open to others: not a place to load code from


def compiler() -> str | None:
    return os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None)


HEADER = Path(__file__).with_name("native_simd.h")  # what every source includes (-I this folder)


def cached(source: Path, defines: list[str]) -> Path:
    """Where a build of ``source`` with ``defines`` for this machine lives (found without a compiler)."""
    suffix = ".dll" if sys.platform == "win32" else ".so"
    stamp = f"|{' '.join(defines)}|{platform.machine()}|{sys.platform}"
    key = hashlib.sha256(source.read_bytes() + HEADER.read_bytes() + stamp.encode()).hexdigest()[:16]
    return build_dir() / f"{source.stem}-{key}{suffix}"


def build(source: Path, defines: list[str]) -> Path:
    """Compile ``source`` (with OpenMP if the compiler has it) into the cache; reuse a build of
    the same source for the same machine. Written to a temporary name and renamed, so
    processes starting together (DDP ranks) never load a half-written library."""
    target = cached(source, defines)
    if target.exists():
        return target
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found; set CC")
    target.parent.mkdir(parents=True, exist_ok=True)
    errors = []
    # OpenMP and per-CPU clones (the sources' SIMD_CLONES) if the toolchain has them, else without
    for flags in (["-fopenmp"], ["-fopenmp", "-DAMPAUDIT_NO_CLONES"], ["-DAMPAUDIT_NO_CLONES"]):
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=target.suffix)
        os.close(fd)
        cmd = [*cc.split(), "-O3", "-shared", "-fPIC", f"-I{HEADER.parent}", *defines, *flags, "-o", tmp, str(source)]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            run, error = None, str(exc)
        if run is not None and run.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        errors.append(error if run is None else (run.stderr.strip().splitlines() or ["failed"])[-1])
    raise OSError(f"{cc} could not build {source.name}: {errors[-1]}")


def load(source: Path) -> ctypes.CDLL | None:
    """``source``'s library, built on first use; None where native code is off (``disabled``)
    or cannot be built here - its callers then take the torch ops or Python's path."""
    if disabled():
        return None
    try:
        return ctypes.CDLL(str(build(source, [])))
    except OSError:
        return None
