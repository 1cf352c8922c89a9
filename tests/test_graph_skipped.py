"""A file that cannot be imported, or whose model cannot be built, is still linted: its lint
findings plus AMP005 (why there is no graph audit, and how to get one), exit by findings.
Exit 2 stays for a model the user named (PATH:NAME) that cannot be built."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.conftest import line_of, model

MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
'''

# A lint finding that does not depend on importing: the deprecated autocast (AMP401, a warning).
TRAIN = '''

def train(model, x):
    with torch.cuda.amp.autocast():
        return model(x)
'''


def _check(cli, path, *flags):
    result = cli("check", path, "--format", "json", *flags)
    assert "Traceback" not in result.err
    return result, (result.json() if result.out else None)


def _codes(report):
    return sorted({f["rule"] for f in report["findings"]})


def _write(tmp_path, name, source):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_a_missing_package_still_lints_and_exits_by_findings(cli, tmp_path):
    path = _write(tmp_path, "train_missing.py", "import torchvision_not_here\n" + MODEL + TRAIN)
    result, report = _check(cli, path)
    assert result.code == 1  # AMP401 is a warning: exit by the findings, not 2
    assert _codes(report) == ["AMP005", "AMP401"]
    skipped = next(f for f in report["findings"] if f["rule"] == "AMP005")
    assert skipped["line"] == 1 and skipped["severity"] == "info"
    assert "no module named 'torchvision_not_here'" in skipped["message"]
    assert "install `torchvision_not_here`" in skipped["message"]
    assert report["target"]["trace"] == "none"
    # Info alone does not fail the run.
    result, report = _check(cli, path, "--ignore", "AMP401")
    assert result.code == 0 and _codes(report) == ["AMP005"]


def test_well_known_pip_names_are_given(cli, tmp_path):
    path = _write(tmp_path, "uses_cv2.py", "import cv2\n" + MODEL)
    _, report = _check(cli, path)
    assert "install `cv2` (pip install opencv-python)" in report["findings"][0]["message"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_at_import_on_a_machine_without_cuda(cli, tmp_path):
    path = _write(tmp_path, "cuda_model.py", MODEL + "\n\nmodel = Net().cuda()\n" + TRAIN)
    result, report = _check(cli, path)
    assert result.code == 1 and _codes(report) == ["AMP005", "AMP401"]
    skipped = next(f for f in report["findings"] if f["rule"] == "AMP005")
    assert skipped["line"] == MODEL.count("\n") + 3  # the `model = Net().cuda()` line
    assert "CUDA" in skipped["message"] and '__name__ == "__main__"' in skipped["message"]


def test_a_factory_that_needs_arguments(cli, tmp_path):
    path = _write(tmp_path, "factory_args.py", MODEL + "\n\ndef build_model(state_dict):\n    return Net()\n")
    result, report = _check(cli, path)
    assert result.code == 0 and _codes(report) == ["AMP005"]
    finding = report["findings"][0]
    assert finding["line"] == MODEL.count("\n") + 3
    assert "build_model() needs arguments (state_dict)" in finding["message"]
    # Named, it is an error: the user asked for that model.
    result, _ = _check(cli, f"{path}:build_model")
    assert result.code == 2 and "build_model() needs arguments (state_dict)" in result.err


def test_a_model_class_that_needs_arguments_is_not_replaced_by_a_part(cli, tmp_path):
    # GPT(config) is the model; NewGELU() is the only class that builds with no arguments, but
    # GPT builds it: auditing NewGELU alone would be wrong.
    path = _write(tmp_path, "gpt_like.py", '''
        from torch import nn


        class NewGELU(nn.Module):
            def forward(self, x):
                return x


        class GPT(nn.Module):
            def __init__(self, config):
                super().__init__()
                self.act = NewGELU()
    ''')
    result, report = _check(cli, path)
    assert result.code == 0 and _codes(report) == ["AMP005"]
    assert "GPT() needs arguments (config)" in report["findings"][0]["message"]
    assert report["findings"][0]["line"] == line_of(path, "class GPT(")


@pytest.mark.parametrize(("fixture", "where", "words"), [
    ("bad_import.py", "import flash_attn_does_not_exist", "no module named 'flash_attn_does_not_exist'"),
    ("factory_raises.py", "raise ValueError", "get_model() raised ValueError: unsupported config"),
    ("ambiguous.py", "class Encoder(", "several nn.Module classes (Encoder, Decoder)"),
])
def test_fixtures_that_cannot_be_built(cli, fixture, where, words):
    result, report = _check(cli, model(fixture))
    assert result.code == 0
    [finding] = report["findings"]
    assert (finding["rule"], finding["line"]) == ("AMP005", line_of(model(fixture), where))
    assert words in finding["message"]


def test_exec_import_that_fails_is_linted_too(cli, tmp_path):
    path = _write(tmp_path, "reads_data.py", MODEL + "\n\ntext = open('no-such-input.txt').read()\n" + TRAIN)
    result, report = _check(cli, path)
    assert _codes(report) == ["AMP003", "AMP401"]  # not imported: open() would run
    result, report = _check(cli, path, "--exec")
    assert result.code == 1 and _codes(report) == ["AMP005", "AMP401"]
    assert "FileNotFoundError" in report["findings"][0]["message"]


def test_convert_still_needs_a_model(cli, tmp_path):
    result = cli("convert", model("bad_import.py"), "-o", tmp_path / "out")
    assert result.code == 2 and "no module named 'flash_attn_does_not_exist'" in result.err


def test_a_package_module_imports_its_package(cli, tmp_path):
    # minGPT's layout: mingpt/model.py does `from mingpt.utils import ...` and `from .layers import ...`.
    package = tmp_path / "proj" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text("WIDTH = 4\n")
    (package / "layers.py").write_text("from torch import nn\n\nclass Block(nn.Linear):\n    pass\n")
    (package / "model.py").write_text(
        "from torch import nn\nfrom mypkg.utils import WIDTH\nfrom .layers import Block\n\n"
        "def get_model():\n    return nn.Sequential(Block(WIDTH, WIDTH))\n")
    result, report = _check(cli, package / "model.py")
    assert result.code == 0, result.err
    assert report["target"]["entry"] == "get_model()" and report["target"]["trace"] == "fx"


@pytest.mark.parametrize("module", ["helpers/__init__.py", "helpers.py"])
def test_a_missing_module_of_the_project_says_so(cli, tmp_path, module):
    package = tmp_path / "proj" / "mypkg"
    package.mkdir(parents=True)
    (tmp_path / "proj" / "helpers").mkdir()  # a sibling package, not on the path the file is run from
    (tmp_path / "proj" / module).write_text("WIDTH = 4\n")
    (package / "model.py").write_text("from helpers import WIDTH\n" + MODEL)
    _, report = _check(cli, package / "model.py")
    assert f"`helpers` is part of this project: run ampaudit from the folder that contains it ({tmp_path / 'proj'})" \
           in report["findings"][0]["message"]


@pytest.mark.parametrize("layout", ["empty folder", "package above the project root", "folder of modules"])
def test_a_folder_named_like_the_missing_module_is_not_called_part_of_the_project(cli, tmp_path, layout):
    # MAE's models_mae.py (imports timm) was told "`timm` is part of this project" because a folder
    # above it held a timm checkout: any folder of that name, anywhere up to /, was enough
    project = tmp_path / "a" / "b" / "proj"
    project.mkdir(parents=True)
    (tmp_path / "timm").mkdir()
    if layout == "package above the project root":
        (project / ".git").mkdir()
        (tmp_path / "timm" / "__init__.py").write_text("")
    elif layout == "folder of modules":  # a checkout's top folder: setup.py, no __init__.py; no project root
        (tmp_path / "timm" / "setup.py").write_text("")
    (project / "m.py").write_text("import timm\n" + MODEL)
    _, report = _check(cli, project / "m.py")
    message = report["findings"][0]["message"]
    assert "part of this project" not in message and "install `timm` to audit the graph" in message


def test_a_folder_of_modules_inside_the_project_is_part_of_it(cli, tmp_path):
    (tmp_path / "proj" / "models").mkdir(parents=True)
    (tmp_path / "proj" / ".git").mkdir()
    (tmp_path / "proj" / "util").mkdir()
    (tmp_path / "proj" / "util" / "pos_embed.py").write_text("")  # MAE's util/: modules, no __init__.py
    (tmp_path / "proj" / "models" / "m.py").write_text("from util.pos_embed import x\n" + MODEL)
    _, report = _check(cli, tmp_path / "proj" / "models" / "m.py")
    assert "`util` is part of this project" in report["findings"][0]["message"]


def test_several_model_classes_that_need_arguments_are_listed(cli, tmp_path):
    path = _write(tmp_path, "zoo.py", '''
        from torch import nn


        class RNN(nn.Module):
            def __init__(self, config):
                super().__init__()


        class MLP(nn.Module):
            def __init__(self, config):
                super().__init__()
    ''')
    _, report = _check(cli, path)
    [finding] = report["findings"]
    assert "the nn.Module classes RNN, MLP all need arguments" in finding["message"]
    assert f'{path}:"RNN(...)"' in finding["message"]


def test_a_script_whose_model_comes_from_a_package_says_where(cli, tmp_path):
    # deit's main.py: `from timm.models import create_model` is not the file's own entry point.
    source = "import torch\nfrom timm.models import create_model\n\n\ndef main():\n    pass\n"
    path = _write(tmp_path, "main.py", source + TRAIN)
    result, report = _check(cli, path)
    assert result.code == 1 and _codes(report) == ["AMP401"]  # linted; nothing imported
    assert ("its create_model comes from timm.models: audit a model that builds with "
            '`ampaudit check timm.models:"create_model(...)"`') in report["target"]["notes"][0]
