"""The promise that holds as a security boundary (docs/check.md, "What ampaudit runs"): `check`
on a folder or on several files, `--lint-only`, the pre-commit hook, `rules`, `explain`, `ops`
and `report` never import or run anything of the user's. Every file below writes a marker when
Python runs it, in each way a static scan of the file could miss (issue 25, item 1)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

MARK = "open(__import__('os').path.join({folder!r}, {name!r}), 'w').close()"

# name -> source; every one writes the marker NAME when its code runs
SOURCES = {
    "helper.py": "{mark}\n",
    "sibling.py": "import helper\n",
    "meta.py": "class Meta(type):\n    def __new__(m, *a):\n        {mark}\n"
               "        return super().__new__(m, *a)\n\n\nclass Model(metaclass=Meta):\n    pass\n",
    "subclass_hook.py": "class Base:\n    def __init_subclass__(cls):\n        {mark}\n\n\n"
                        "class Model(Base):\n    pass\n",
    "post_init.py": "from dataclasses import dataclass\n\n\n@dataclass\nclass Cfg:\n    n: int = 1\n\n"
                    "    def __post_init__(self):\n        {mark}\n\n\ncfg = Cfg()\n",
    "str_method.py": "class Tools:\n    @staticmethod\n    def join():\n        {mark}\n\n\nTools.join()\n",
    "add_operator.py": "class C:\n    def __add__(self, other):\n        {mark}\n        return self\n\n\n"
                       "c = C() + 1\n",
    "pkg/__init__.py": "{mark}\n",
    "pkg/layers.py": "from . import __name__ as _n\n{mark}\n",
    "pkg/model.py": "from . import layers\n",
    "pkg/__main__.py": "{mark}\n",
    "conftest.py": "{mark}\n",
    "setup.py": "{mark}\n",
    "train.py": "import torch\nscaler = torch.cuda.amp.GradScaler()\n{mark}\n",
}
PTH = "evil.pth"  # site's .pth lines run at interpreter start-up, when in a site folder


def _tree(root: Path, markers: Path) -> list[Path]:
    files = []
    for name, source in SOURCES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        mark = MARK.format(folder=str(markers), name=name.replace("/", "_"))
        path.write_text(source.format(mark=mark))
        files.append(path)
    (root / PTH).write_text(f"import os; {MARK.format(folder=str(markers), name=PTH)}\n")
    return files


def test_commands_that_promise_no_import_run_nothing(tmp_path):
    root, markers = tmp_path / "project", tmp_path / "markers"
    markers.mkdir()
    files = _tree(root, markers)
    log = Path(__file__).parents[1] / "fixtures" / "watch" / "AMP605_invalid.jsonl"
    commands = [
        ["check", str(root)],  # a folder: the lint only
        ["check", str(files[0]), str(files[1]), str(root / "meta.py")],  # several files
        *(["check", str(f), "--lint-only"] for f in files),
        ["check", "--lint-only", "--", *map(str, files)],  # the pre-commit hook's argv
        ["check", str(root), "--lint-only", "--fix"],
        ["rules"], ["explain", "AMP401"], ["ops", "softmax"], ["report", str(log)],
    ]
    script = ("import json, sys\nfrom ampaudit.cli.main import main\n"
              "print(json.dumps([main(argv) for argv in json.loads(sys.argv[1])]))\n")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(commands)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)  # not cwd=root: `python -c` would put the tree on sys.path
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(code in (0, 1) for code in codes), (codes, done.stderr[-2000:])
    assert sorted(p.name for p in markers.iterdir()) == []
    # the markers do fire when Python runs the files: the tree tests what it claims to
    subprocess.run([sys.executable, "-c", "import sibling, meta, subclass_hook, post_init, str_method, add_operator, "
                    "pkg.model"], cwd=root, capture_output=True, timeout=60)
    fired = sorted(p.name for p in markers.iterdir())
    assert fired == sorted(["helper.py", "meta.py", "subclass_hook.py", "post_init.py", "str_method.py",
                            "add_operator.py", "pkg___init__.py", "pkg_layers.py"]), fired
