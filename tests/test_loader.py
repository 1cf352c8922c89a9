"""Loading PATH[:NAME]: entry-point order, example inputs, and never running a training loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ampaudit.core.errors import LoadError
from ampaudit.load.loader import NotImported, load_target
from ampaudit.load.source_scan import scan_source
from ampaudit.load.spec import parse_target
from tests.conftest import line_of, model


@pytest.mark.parametrize(("spec", "expected"), [
    ("model.py", (Path("model.py"), None)),
    ("model.py:Net", (Path("model.py"), "Net")),
    ("dir/model.py:make_it", (Path("dir/model.py"), "make_it")),
    ("C:/x/model.py", (Path("C:/x/model.py"), None)),  # a drive letter is not a NAME
])
def test_parse_target(spec, expected):
    assert parse_target(spec) == expected


def test_factory_wins_and_inputs_come_from_the_file():
    loaded = load_target(model("clean_cnn.py"))
    assert loaded.entry == "get_model()"
    assert loaded.inputs.origin == "example_inputs()"
    assert loaded.inputs.args[0].shape == (2, 3, 16, 16)
    assert not loaded.model.training  # audited in eval mode


def test_single_no_arg_class_is_constructed():
    loaded = load_target(model("input_shape.py"))
    assert loaded.entry == "MLP()"
    assert loaded.inputs is None


@pytest.mark.parametrize(("name", "entry", "width"), [("small", "small", 8), ("tiny", "tiny()", 4)])
def test_named_instance_and_factory(name, entry, width):
    loaded = load_target(f"{model('named_entries.py')}:{name}", input_shapes=[f"2,{width}"])
    assert loaded.entry == entry
    assert loaded.inputs.args[0].shape == (2, width)


def test_dict_example_inputs_are_kwargs():
    loaded = load_target(model("kwargs_inputs.py"))
    assert set(loaded.inputs.kwargs) == {"input_ids", "attention_mask"}
    assert loaded.inputs.args == ()


def test_input_shape_and_dtype_flags():
    loaded = load_target(model("input_shape.py"), input_shapes=["3,8", "5"], input_dtypes=["float32", "int64"])
    first, second = loaded.inputs.args
    assert first.shape == (3, 8) and first.dtype == torch.float32
    assert second.shape == (5,) and second.dtype == torch.int64 and set(second.tolist()) <= {0, 1}


def test_training_script_is_not_imported():
    result = load_target(model("train_script.py"))
    assert isinstance(result, NotImported)
    assert (result.line, result.what) == (line_of(model("train_script.py"), "for step in range(10):"), "a for loop")


def test_main_guard_is_never_run():
    # guarded_script.py raises SystemExit("training ran!") first thing in its main block.
    loaded = load_target(model("guarded_script.py"))
    assert loaded.entry == "get_model()"


def test_exec_imports_a_script_anyway():
    loaded = load_target(model("train_script.py"), allow_exec=True)
    assert loaded.entry == "model"


@pytest.mark.parametrize(("source", "unsafe"), [
    ("import torch\nx = 1\n", None),
    ("def f():\n    pass\nf()\n", (3, "a call to `f()`")),
    ("while True:\n    pass\n", (1, "a while loop")),
    ("with open('x') as fh:\n    pass\n", (1, "a with block")),
    ("try:\n    import apex\nexcept ImportError:\n    apex = None\n", None),
    ("if __name__ == '__main__':\n    train()\n", None),
    ("'''doc'''\nif DEBUG:\n    run()\n", (3, "a call to `run()`")),
])
def test_top_level_safety(source, unsafe):
    scan = scan_source(Path("x.py"), source)
    assert (scan.unsafe[0], scan.unsafe[2]) == unsafe if unsafe else scan.unsafe is None


def test_file_folder_goes_on_sys_path(tmp_path):
    (tmp_path / "layers.py").write_text("from torch import nn\nclass Block(nn.Linear):\n    pass\n")
    (tmp_path / "net.py").write_text(
        "from torch import nn\nfrom layers import Block\n\ndef get_model():\n    return nn.Sequential(Block(4, 4))\n")
    assert load_target(str(tmp_path / "net.py")).entry == "get_model()"


def test_factory_returning_non_module(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def get_model():\n    return 3\n")
    with pytest.raises(LoadError, match=r"get_model\(\) is int, not an nn.Module"):
        load_target(str(path))


def test_the_class_no_other_class_builds_is_the_model(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from torch import nn\n\nclass Part(nn.Module):\n    def forward(self, x):\n        return x\n\n"
        "class Whole(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.p = Part()\n\n"
        "    def forward(self, x):\n        return self.p(x)\n")
    assert load_target(str(path)).entry == "Whole()"


def test_user_siblings_never_shadow_ampaudit_imports(tmp_path, monkeypatch):
    # A sibling named like a stdlib module: the model file gets it (as `python net.py` would),
    # ampaudit's own later imports get the real one, and sys.path keeps its order.
    import sys

    (tmp_path / "colorsys.py").write_text("SIBLING = True\n")
    (tmp_path / "net.py").write_text(
        "from torch import nn\nimport colorsys\n\n"
        "def get_model():\n    assert colorsys.SIBLING\n    return nn.Linear(2, 2)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # both put back after the test
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    before = list(sys.path)
    loaded = load_target(str(tmp_path / "net.py"))
    assert loaded.entry == "get_model()" and isinstance(loaded.model, torch.nn.Linear)
    assert sys.path[: len(before)] == before and sys.path[len(before):] == [str(tmp_path.resolve())]
    import colorsys

    assert not hasattr(colorsys, "SIBLING") and hasattr(colorsys, "rgb_to_hsv")


def test_file_named_like_a_stdlib_module_gets_a_private_name(tmp_path, monkeypatch):
    import sys

    (tmp_path / "tabnanny.py").write_text("from torch import nn\n\ndef get_model():\n    return nn.Linear(2, 2)\n")
    monkeypatch.delitem(sys.modules, "tabnanny", raising=False)
    assert isinstance(load_target(str(tmp_path / "tabnanny.py")).model, torch.nn.Linear)
    import tabnanny

    assert hasattr(tabnanny, "check")


def test_lazy_sibling_import_still_resolves_after_load(tmp_path):
    (tmp_path / "helpers_lazy_x1.py").write_text("def scale(x):\n    return x * 2\n")
    (tmp_path / "net.py").write_text(
        "import torch\nfrom torch import nn\n\nclass Net(nn.Module):\n    def forward(self, x):\n"
        "        from helpers_lazy_x1 import scale\n        return scale(x)\n\n"
        "def get_model():\n    return Net()\n")
    model = load_target(str(tmp_path / "net.py")).model
    assert model(torch.ones(1)).item() == 2.0


def test_import_timeout_stops_code_that_swallows_the_first_stop(tmp_path):
    # a bare `except:` catches the first stop; the limit fires again, and the line is reported
    from ampaudit.core.errors import ModelNotBuilt

    path = tmp_path / "m.py"
    path.write_text("from torch import nn\n\n\ndef get_model():\n    while True:\n        try:\n"
                    "            while True:\n                pass\n        except BaseException:\n"
                    "            pass\n")
    with pytest.raises(ModelNotBuilt, match=r"stopped after 0.3 s at line \d+ \(--import-timeout\)") as err:
        load_target(f"{path}:get_model", import_timeout=0.3)
    assert err.value.line in (5, 6, 7, 8, 9, 10)


@pytest.mark.child_process  # the parent of the real child process keeps the clock
def test_import_timeout_on_the_lint_path_is_an_info_finding(cli, tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text("from torch import nn\n\n\ndef slow(fn):\n    while True: pass\n\n\n\n"
                                   "@slow\ndef get_model():\n    return nn.Linear(2, 2)\n")  # the loop: one line
    monkeypatch.chdir(tmp_path)
    result = cli("check", "m.py", "--exec", "--import-timeout", "0.3", "--format", "json")
    assert result.code == 0
    (finding,) = result.json()["findings"]
    assert (finding["rule"], finding["line"]) == ("AMP005", 5)
    assert "still running after 0.3 s, stopped at line 5" in finding["message"]


def test_a_torch_compiled_model_is_loaded_as_the_module_it_wraps(tmp_path):
    # `model = torch.compile(Net())` at top level: dynamo's wrapper cannot be traced or copied;
    # the module it wraps is the model the user wrote
    (tmp_path / "m.py").write_text("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
                                   "    def __init__(self):\n        super().__init__()\n"
                                   "        self.fc = nn.Linear(4, 4)\n\n    def forward(self, x):\n"
                                   "        return self.fc(x)\n\n\nmodel = torch.compile(Net())\n")
    loaded = load_target(str(tmp_path / "m.py"))
    assert type(loaded.model).__name__ == "Net" and loaded.entry == "model._orig_mod"
    assert loaded.notes == ["the model is torch.compile'd: the module it wraps (_orig_mod) was used"]
