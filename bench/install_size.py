"""Benchmark: what `pip install ampaudit` (the lint alone) costs, next to `ampaudit[torch]`.

Builds ampaudit's wheel from this checkout, gathers wheels of its dependencies offline
(tests/wheelhouse.py: installed pure-Python distributions zipped back; the others - torch,
safetensors, MarkupSafe - from `pip download`, which finds a local torch wheel where pip's
configuration names one), then installs each variant into a fresh venv with `pip install
--no-index --find-links` and reports the install time and the bytes it added to site-packages
(a bare venv's site-packages is empty: `venv --without-pip`).

Run: python bench/install_size.py [--rounds 3] [--lint-only]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import wheelhouse  # noqa: E402


def _size(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*") if p.is_file() and not p.is_symlink()]
    return sum(p.stat().st_size for p in files), len(files)


def _install(house: Path, requirement: str, work: Path) -> tuple[float, int, int, int]:
    """Seconds, site-packages bytes and files, and distributions of one fresh install."""
    venv = work / "venv"
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--find-links", str(house), requirement], check=True, env=env)
    seconds = time.perf_counter() - start
    (site,) = venv.glob("lib/python*/site-packages")
    size, files = _size(site)
    return seconds, size, files, len(list(site.glob("*.dist-info")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh installs per variant (default 3)")
    parser.add_argument("--lint-only", action="store_true", help="skip the torch variant")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ampaudit-install-") as tmp:
        work = Path(tmp)
        house = work / "wheels"
        house.mkdir()
        subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                        "--quiet", "-w", str(house)], check=True)
        (wheel,) = house.glob("ampaudit-*.whl")
        variants = {"ampaudit (the lint)": "ampaudit"}
        wheelhouse.fill(house, wheelhouse.wheel_requires(wheel))
        if not args.lint_only:
            extra = [r for r in wheelhouse.wheel_requires(wheel) if "extra == \"torch\"" in r.replace("'", '"')]
            import torch  # the torch this machine has: the same version, from a local wheel where one is

            wheelhouse.fill(house, [f"torch=={torch.__version__}", *(r.split(";")[0] for r in extra)])
            variants['ampaudit[torch]'] = "ampaudit[torch]"
        print(f"wheels in {house.name}: {len(list(house.glob('*.whl')))}, "
              f"{sum(p.stat().st_size for p in house.glob('*.whl')) / 1e6:.1f} MB")
        for label, requirement in variants.items():
            runs = [_install(house, requirement, work) for _ in range(args.rounds)]
            times = sorted(r[0] for r in runs)
            _, size, files, dists = runs[-1]
            print(f"{label:22} {size / 1e6:8.1f} MB in site-packages ({files} files, {dists} distributions), "
                  f"install {times[0]:.1f}-{times[-1]:.1f} s (median {times[len(times) // 2]:.1f} s)")


if __name__ == "__main__":
    main()
