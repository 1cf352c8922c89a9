"""The import guard is sound: code that would run on import keeps the file from being imported.

Each case is a model file whose top level reaches ``train()`` - which writes a marker file -
through one construct. Without --exec the marker must never appear (the file is linted and
AMP003 points at the construct); with --exec the file is imported and the marker appears.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ampaudit.load.source_scan import scan_source

HEADER = '''\
from pathlib import Path

import torch
from torch import nn

MARKER = {marker!r}


def train(*args, **kwargs):
    Path(MARKER).write_text("training ran")
    return True


class Net(nn.Module):
    def forward(self, x):
        return x * 2


def get_model():
    return Net()

'''

# name -> the top-level code; `# here` marks the line AMP003 must point at.
CASES = {
    "call": "train()  # here",
    "assignment": "result = train()  # here",
    "print": "print(train())  # here",
    "default-argument": "def f(x=train()):  # here\n    return x",
    "keyword-default": "def f(*, x=train()):  # here\n    return x",
    "lambda-default": "f = lambda x=train(): x  # here",
    "if-test": "if train():  # here\n    pass",
    "walrus-in-if": "if (ok := train()):  # here\n    pass",
    "elif-test": "if False:\n    pass\nelif train():  # here\n    pass",
    "decorator": "def deco(fn):\n    train()\n    return fn\n\n\n@deco  # here\ndef f():\n    pass",
    "decorator-call": "@train()  # here\ndef f():\n    pass",
    "class-decorator": "def deco(cls):\n    train()\n    return cls\n\n\n@deco  # here\nclass Config:\n    pass",
    "class-body": "class Config:\n    steps = train()  # here",
    "method-default": "class Block(nn.Module):\n    def __init__(self, x=train()):  # here\n        super().__init__()",
    "method-decorator": "class Block(nn.Module):\n    @train  # here\n    def forward(self, x):\n        return x",
    "class-bases": "def base():\n    train()\n    return object\n\n\nclass Config(base()):  # here\n    pass",
    "with-block": "with open(MARKER, 'w'):  # here\n    pass",
    "for-loop": "for _ in range(1):  # here\n    train()",
    "while-loop": "while not train():  # here\n    pass",
    "comprehension": "flags = [train() for _ in range(1)]  # here",
    "f-string": 'label = f"{train()}"  # here',
    "augmented-assignment": "n = 0\nn += train()  # here",
    "try-body": "try:\n    train()  # here\nexcept Exception:\n    pass",
    "constructor-argument": "model = Net(train())  # here",
    "model-method-argument": "model = Net().to(train())  # here",
    "module-method": "model = Net()\nmodel.apply(train)  # here",
    "shadowed-builtin": "def sorted(x):\n    train()\n    return x\n\n\nys = sorted([1])  # here",
    "attribute-target": "import types\n\nns = types.SimpleNamespace()  # here\nns.x = train()",
    "subscript-target": "table = {}\ntable['k'] = train()  # here",
    "method-on-a-pure-value": "Path(MARKER).write_text('ran')  # here",
    "module-function": "import os\n\nos.makedirs(MARKER)  # here",
    "star-argument": "top = max(*[train(), 0])  # here",
    "assert": "assert train()  # here",
    "local-function-as-value": "run = train\nrun()  # here",
    "dict-default": "def f(x={'a': train()}):  # here\n    return x",
}


def _write(tmp_path: Path, name: str) -> tuple[Path, Path, int]:
    marker = tmp_path / "marker"
    source = HEADER.format(marker=str(marker)) + textwrap.dedent(CASES[name]) + "\n"
    path = tmp_path / f"case_{name.replace('-', '_')}.py"
    path.write_text(source)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if text.rstrip().endswith("# here"))
    return path, marker, line


@pytest.mark.parametrize("name", sorted(CASES))
def test_code_that_runs_on_import_is_never_run(cli, tmp_path, name):
    path, marker, line = _write(tmp_path, name)
    result = cli("check", path, "--format", "json", "--fail-on", "never")
    assert result.code == 0, result.err
    assert not marker.exists(), f"{name}: importing ran the user's code"
    report = result.json()
    assert report["target"]["trace"] == "none"
    assert [(f["rule"], f["line"]) for f in report["findings"] if f["rule"] == "AMP003"] == [("AMP003", line)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_exec_imports_it(cli, tmp_path, name):
    path, marker, _ = _write(tmp_path, name)
    result = cli("check", path, "--exec", "--format", "json", "--fail-on", "never")
    assert result.code in (0, 1), result.err
    assert marker.exists(), f"{name}: --exec did not import the file"


def test_the_message_names_the_construct(cli, tmp_path):
    path, _, _ = _write(tmp_path, "decorator")
    finding = next(f for f in cli("check", path, "--format", "json").json()["findings"] if f["rule"] == "AMP003")
    assert "the decorator `@deco`" in finding["message"]
    path, _, _ = _write(tmp_path, "default-argument")
    finding = next(f for f in cli("check", path, "--format", "json").json()["findings"] if f["rule"] == "AMP003")
    assert "a call to `train()` in a default argument" in finding["message"]


PURE = '''\
"""Everything here is known not to run the file's own code: the file is imported."""
import logging
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
logger = logging.getLogger(__name__)
TORCH_MAJOR = int(torch.__version__.split(".")[0])
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.backends.cudnn.benchmark = True
NAMES = sorted(name for name in vars(F) if name.islower() and not name.startswith("_"))
os.environ["TOKENIZERS_PARALLELISM"] = os.environ.get("TOKENIZERS_PARALLELISM", "false")
torch.manual_seed(0)


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_embd: int = 8
    dropout: Optional[float] = None
    tags: list = field(default_factory=list)


@torch.jit.script
def gelu(x):
    return x * 0.5


class Block(nn.Module):
    def __init__(self, config: GPTConfig, norm=partial(nn.LayerNorm, eps=1e-6), act=nn.GELU()):
        super().__init__()
        self.norm = norm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, config.n_embd)

    @property
    def width(self):
        return self.fc.in_features

    @torch.no_grad()
    def reset(self):
        self.fc.reset_parameters()

    def forward(self, x):
        return self.fc(self.norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig = GPTConfig()):
        super().__init__()
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


model = GPT(GPTConfig(n_layer=2, n_embd=8)).to(device).eval()

if __name__ == "__main__":
    raise SystemExit("training ran!")
'''


def test_pure_top_level_is_imported(cli, tmp_path):
    path = tmp_path / "pure_model.py"
    path.write_text(PURE)
    assert scan_source(path, PURE).unsafe is None
    result = cli("check", path, "--format", "json", "--input-shape", "2,8")
    assert result.code == 0, result.err
    report = result.json()
    assert report["target"]["entry"] == "model" and report["target"]["trace"] == "fx"


def test_an_imported_factory_is_not_the_files_entry_point(tmp_path):
    # `from timm.models import create_model` in a training script: not this file's model.
    source = "from somewhere import create_model, model\n\ndef main():\n    pass\n"
    scan = scan_source(tmp_path / "train.py", source)
    assert scan.factories == [] and not scan.has_model_attribute and not scan.has_entry_point
    scan = scan_source(tmp_path / "m.py", "from somewhere import create_model\n\ndef create_model():\n    pass\n")
    assert scan.factories == ["create_model"]


TRAINING_SCRIPT = '''\
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):  # runs on import: AMP003
    optimizer.step()
'''

# Runs `check` in a fresh interpreter with the child process replaced by a recorder; prints
# whether torch was imported and which jobs went to a child.
PROBE = '''\
import json, sys
import ampaudit.core.child as child
from ampaudit.core.errors import NoModelFound
started = []
def run_in_child(module, function, *args, **kwargs):
    started.append(function)
    raise NoModelFound("child not started in this test")
child.run_in_child = run_in_child
from ampaudit.cli.main import main
code = main(json.loads(sys.argv[1]))
print(json.dumps({"code": code, "torch": "torch" in sys.modules, "children": started}))
'''


def _probe(tmp_path: Path, *argv: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}  # this checkout's ampaudit
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(list(argv))], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_file_that_is_not_imported_never_imports_torch(tmp_path):
    """AMP003 is decided from the source before torch is imported: `check train.py` on a
    training script costs the lint, not a torch import in a child (issue 27, item 10)."""
    path = tmp_path / "train.py"
    path.write_text(TRAINING_SCRIPT)
    probe = _probe(tmp_path, "check", str(path), "--format", "json", "--fail-on", "never")
    assert probe == {"code": 0, "torch": False, "children": []}
    # with --exec the file is to be imported: that does go to the child
    probe = _probe(tmp_path, "check", str(path), "--exec", "--format", "json", "--fail-on", "never")
    assert probe["children"] == ["_graph"] and probe["torch"] is False


def test_a_bad_policy_fails_on_a_file_that_is_not_imported_too(cli, tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TRAINING_SCRIPT)
    policy = tmp_path / "policy.toml"
    policy.write_text("x = \n")
    result = cli("check", path, "--policy", policy)
    assert result.code == 2 and "cannot read policy file" in result.err
