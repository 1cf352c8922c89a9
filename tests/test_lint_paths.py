"""Path-aware protocol rules: every shape of AMP switch real trainers use keeps the fp32
branch out of the scaler protocol, and a bug on the AMP branch is still found."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ampaudit.check.lint_file import lint_source

TEMPLATE = '''
import torch


class Trainer:
    def step(self, model, x, optimizer, scaler, use_amp, args, cfg, config, dtype):
        loss = model(x).sum()
        if {test}:
            {amp_branch}
        else:
            {fp32_branch}
'''
AMP_OK = "scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()"
FP32 = "loss.backward(); optimizer.step()"

# (test that is true when AMP is on) - the AMP code in the body, the fp32 code in the else
ON_TESTS = [
    "use_amp", "args.fp16", "self.fp16", "cfg.mixed_precision", "self.use_amp", "scaler is not None",
    "scaler", "scaler.is_enabled()", "args.fp16 == True", "config['use_fp16']", "cfg.get('amp')",
    "self.amp_type == 'pytorch'", "self.amp_type == AmpType.PYTORCH", "dtype != torch.float32",
    "dtype == torch.float16", "args.precision == '16-mixed'", "use_amp and torch.cuda.is_available()",
    "not self.fp32", "self.amp_type != AmpType.NONE",
]
# the same, written the other way round: true when AMP is off
OFF_TESTS = ["not use_amp", "scaler is None", "dtype == torch.float32", "self.fp32", "args.fp16 == False",
             "args.precision == 'fp32'", "not args.fp16 or not torch.cuda.is_available()"]


def _codes(source: str) -> list[tuple[str, int]]:
    return sorted((f.rule, f.line) for f in lint_source("t.py", textwrap.dedent(source)))


@pytest.mark.parametrize("test", ON_TESTS)
def test_fp32_branch_of_an_amp_switch_is_not_held_to_the_scaler_protocol(test):
    assert _codes(TEMPLATE.format(test=test, amp_branch=AMP_OK, fp32_branch=FP32)) == []


@pytest.mark.parametrize("test", OFF_TESTS)
def test_a_switch_written_the_other_way_round(test):
    assert _codes(TEMPLATE.format(test=test, amp_branch=FP32, fp32_branch=AMP_OK)) == []


@pytest.mark.parametrize("test", ["use_amp", "scaler is not None", "self.amp_type == AmpType.PYTORCH"])
def test_a_bug_on_the_amp_branch_is_still_found_and_names_the_guard(test):
    bug = "scaler.scale(loss).backward(); optimizer.step(); scaler.update()"
    found = lint_source("t.py", TEMPLATE.format(test=test, amp_branch=bug, fp32_branch=FP32))
    assert [(f.rule, f.line) for f in found] == [("AMP405", 9)]
    assert found[0].message.endswith(f"(on the path where `{test}`)")


def test_elif_chain_of_amp_kinds_leaves_the_last_else_fp32():
    source = '''
    def step(self, loss, optimizer):
        if self.amp_type == AmpType.APEX:
            with apex.amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
        elif self.amp_type == AmpType.PYTORCH:
            self.amp_grad_scaler.scale(loss).backward()
        else:
            loss.backward()
        if self.amp_type == AmpType.PYTORCH:
            self.amp_grad_scaler.step(optimizer)
            self.amp_grad_scaler.update()
        else:
            optimizer.step()
    '''
    assert [c for c, _ in _codes(source) if c != "AMP402"] == []


def test_early_continue_leaves_the_rest_of_the_loop_on_the_amp_path():
    source = '''
    import torch
    def train(model, loader, optimizer, use_amp):
        scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
        for x in loader:
            loss = model(x).sum()
            if not use_amp:
                loss.backward()
                optimizer.step()
                continue
            scaler.scale(loss).backward()
            optimizer.step()
            scaler.update()
    '''
    # (no autocast in the snippet: AMP425 says the model trains in fp32 - not this test's concern)
    assert [(c, line) for c, line in _codes(source) if c != "AMP425"] == [("AMP405", 12)]


def test_a_maybe_scaler_alone_makes_a_warning_not_an_error():
    source = '''
    import torch
    def train(model, loader, optimizer, use_amp):
        scaler = torch.amp.GradScaler("cuda", enabled=use_amp)
        for x in loader:
            with torch.autocast("cuda", enabled=use_amp):
                loss = model(x).sum()
            scaler.scale(loss).backward()
            optimizer.step()
            scaler.update()
    '''
    (found,) = lint_source("t.py", textwrap.dedent(source))
    assert (found.rule, found.line, found.severity.value) == ("AMP405", 9, "warning")
    assert found.message.endswith("(when scaler is enabled)")


def test_disabled_scaler_is_no_scaler():
    source = '''
    import torch
    def train(model, x, optimizer):
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
    '''
    assert _codes(source) == []


@pytest.mark.parametrize("backward", [
    "accelerator.backward(loss)", "self.manual_backward(loss)", "self.backward(loss)",
    "engine.backward(loss)", "loss_scaler(loss, optimizer, parameters=model.parameters())",
])
def test_wrapper_backwards_are_not_raw_backward(backward):
    source = f'''
    import torch
    def train(self, model, x, optimizer, accelerator, engine, loss_scaler):
        with torch.autocast("cuda"):
            loss = model(x).sum()
        {backward}
    '''
    assert _codes(source) == []


def test_apex_scale_loss_backward_is_scaled():
    source = '''
    import torch
    from apex import amp
    def train(model, x, optimizer, use_apex):
        scaler = torch.amp.GradScaler("cuda")
        loss = model(x).sum()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        scaler.step(optimizer)
        scaler.update()
    '''
    assert _codes(source) == [("AMP402", 3)]


def test_scaled_backward_through_typing_cast():
    source = '''
    import torch
    from typing import cast
    def train(model, x, optimizer, scaler):
        with torch.autocast("cuda"):
            loss = model(x).sum()
        cast(torch.Tensor, scaler.scale(loss)).backward()
        scaler.step(optimizer)
        scaler.update()
    '''
    assert _codes(source) == []


def test_autocast_bound_to_a_name_with_a_variable_dtype():
    source = '''
    import torch
    from contextlib import nullcontext
    dtype = "float16"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    def train(model, x, optimizer):
        with ctx:
            loss = model(x).sum()
        loss.backward()
        optimizer.step()
    '''
    (found,) = lint_source("t.py", textwrap.dedent(source))
    assert (found.rule, found.line, found.severity.value) == ("AMP403", 8, "warning")
    assert found.message.endswith("(if ptdtype is float16)")


def test_two_scalers_each_with_its_own_optimizer():
    source = '''
    import torch
    def train(G, D, g_opt, d_opt, x):
        d_scaler = torch.amp.GradScaler("cuda")
        g_scaler = torch.amp.GradScaler("cuda")
        d_scaler.scale(D(x).mean()).backward()
        d_scaler.unscale_(d_opt)
        torch.nn.utils.clip_grad_norm_(D.parameters(), 1.0)
        d_scaler.step(d_opt)
        d_scaler.update()
        g_scaler.scale(D(G(x)).mean()).backward()
        g_opt.step()
        g_scaler.update()
    '''
    (found,) = lint_source("t.py", textwrap.dedent(source))
    assert (found.rule, found.line) == ("AMP405", 12)
    assert "g_scaler.step(g_opt)" in found.message


def test_unsafe_fix_guards_a_scaler_that_may_be_none(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
    import torch
    def train(model, x, optimizer, use_amp):
        scaler = torch.amp.GradScaler("cpu") if use_amp else None
        loss = model(x).sum()
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    '''))
    # --ignore AMP425: the snippet has no autocast, its model trains in fp32 (not this test's concern)
    result = cli("check", str(script), "--lint-only", "--fix", "--unsafe-fixes", "--ignore", "AMP425")
    assert result.code == 0, result.out + result.err
    fixed = script.read_text()
    assert "    if scaler is not None: scaler.unscale_(optimizer)\n    torch.nn.utils.clip_grad_norm_" in fixed
    namespace: dict = {}
    exec(compile(fixed, str(script), "exec"), namespace)
    for use_amp in (True, False):  # the fixed script runs with AMP on and off
        model = torch.nn.Linear(4, 1)
        namespace["train"](model, torch.randn(2, 4), torch.optim.SGD(model.parameters(), lr=0.1), use_amp)


import torch  # noqa: E402  (used by the last test only)


def test_deprecated_api_in_a_fallback_is_left_alone():
    source = '''
    import torch
    from packaging import version
    try:
        from torch.amp import GradScaler
    except ImportError:
        from torch.cuda.amp import GradScaler
    if version.parse(torch.__version__) >= version.parse("2.4"):
        autocast = torch.amp.autocast
    else:
        autocast = torch.cuda.amp.autocast
    '''
    assert _codes(source) == []


# Lightning's precision plugins (fabric/plugins/precision/amp.py:54) and the other ways a torch
# version flag is spelled or assigned: the deprecated call runs on old torch only
VERSION_FLAGS = {
    "imported_flag": ("from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_4",
                      "_TORCH_GREATER_EQUAL_2_4"),
    "spelled_flag": ("from .utils import TORCH_GE_2_4", "TORCH_GE_2_4"),
    "transformers_flag": ("from transformers.pytorch_utils import is_torch_less_than_2_4",
                          "not is_torch_less_than_2_4"),
    "transformers_call": ("from transformers.utils import is_torch_greater_or_equal",
                          'is_torch_greater_or_equal("2.4")'),
    "packaging_version": ('new_amp = Version(torch.__version__) >= Version("2.4")', "new_amp"),
    "string_compare": ('_AMP_NEW = torch.__version__ >= "2.4"', "_AMP_NEW"),
    "compare_version": ('has_new_scaler = compare_version("torch", operator.ge, "2.4.0")', "has_new_scaler"),
    "requirement": ('_NEW_SCALER = RequirementCache("torch>=2.4")', "_NEW_SCALER"),
    "annotated_and_chained": ('_NEW: bool = Version(torch.__version__) >= Version("2.4")\nnew_and_cuda = _NEW and cuda',
                              "new_and_cuda"),
    "requirement_in_test": ("", 'RequirementCache("torch>=2.4")'),
}


@pytest.mark.parametrize("binding, test", VERSION_FLAGS.values(), ids=VERSION_FLAGS)
def test_a_fallback_under_a_torch_version_flag_is_left_alone(binding, test):
    header = f"import torch\n{binding}\n\n\n"
    expression = f"def make(device):\n    return torch.amp.GradScaler(device=device) if {test} else " \
                 "torch.cuda.amp.GradScaler()\n"
    statement = f"def make(device):\n    if {test}:\n        return torch.amp.GradScaler(device)\n" \
                "    else:\n        return torch.cuda.amp.GradScaler()\n"
    assert _codes(header + expression) == []
    assert _codes(header + statement) == []


def test_a_version_flag_local_to_a_function_covers_that_function_only():
    source = """
    import torch


    def make(device):
        new = torch.__version__ >= "2.4"
        return torch.amp.GradScaler(device) if new else torch.cuda.amp.GradScaler()


    def other(new):
        return torch.amp.GradScaler("cuda") if new else torch.cuda.amp.GradScaler()
    """
    assert _codes(source) == [("AMP401", 11)]


@pytest.mark.parametrize("binding, test", [
    ("new_api = args.version == 2", "new_api"),  # a version, not torch's
    ("_TORCH_COMPILE = True", "_TORCH_COMPILE"),  # torch_ and no version number
    ("from .flags import TORCH_IS_AVAILABLE", "TORCH_IS_AVAILABLE"),
])
def test_a_flag_that_is_no_torch_version_test_still_reports(binding, test):
    source = f"import torch\n{binding}\n\nscaler = torch.amp.GradScaler('cuda') if {test} else " \
             "torch.cuda.amp.GradScaler()\n"
    assert _codes(source) == [("AMP401", 4)]


OLD_TORCH_FILE = """
import torch
from lightning.fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_4


def make(device):
    return torch.amp.GradScaler(device=device) if _TORCH_GREATER_EQUAL_2_4 else torch.cuda.amp.GradScaler()


def train(model, x):
    scaler = torch.cuda.amp.GradScaler()
    with torch.cuda.amp.autocast():
        loss = model(x)
    scaler.scale(loss).backward()
"""


def test_a_rewrite_to_an_api_older_torch_lacks_is_unsafe_in_a_file_that_runs_on_it():
    # torch.amp.GradScaler is torch 2.3's: the file's version flag says it runs on older torch
    found = {(f.rule, f.line): f for f in lint_source("t.py", OLD_TORCH_FILE)}
    assert sorted(found) == [("AMP401", 11), ("AMP401", 12)]
    scaler, autocast = found["AMP401", 11], found["AMP401", 12]
    assert not scaler.autofix.safe and "torch >= 2.3" in scaler.fix
    assert autocast.autofix.safe  # torch.amp.autocast("cuda") runs on every torch 2
    # without the flag, nothing says the file runs on older torch: the same rewrite is safe
    plain = OLD_TORCH_FILE.replace("_TORCH_GREATER_EQUAL_2_4", "True").replace(
        "from lightning.fabric.utilities.imports import True\n", "")
    assert all(f.autofix.safe for f in lint_source("t.py", plain))


def test_fix_leaves_a_version_gated_fallback_and_the_unsafe_rewrite_alone(tmp_path, cli):
    script = tmp_path / "amp.py"
    script.write_text(OLD_TORCH_FILE)
    assert cli("check", str(script), "--lint-only", "--fix").code == 1  # the GradScaler's finding stays
    fixed = script.read_text()
    assert "if _TORCH_GREATER_EQUAL_2_4 else torch.cuda.amp.GradScaler()" in fixed  # the fallback
    assert "scaler = torch.cuda.amp.GradScaler()" in fixed and 'torch.amp.autocast("cuda")' in fixed
    assert cli("check", str(script), "--lint-only", "--fix", "--unsafe-fixes").code == 0
    assert 'scaler = torch.amp.GradScaler("cuda")' in script.read_text()


def test_deprecated_module_alias_is_fixed_with_its_uses(tmp_path, cli):
    script = tmp_path / "train.py"
    script.write_text("from torch.cuda import amp\n\nscaler = amp.GradScaler()\nwith amp.autocast():\n    pass\n")
    assert cli("check", str(script), "--lint-only", "--fix").code == 0
    assert script.read_text() == ('from torch import amp\n\nscaler = amp.GradScaler("cuda")\n'
                                  'with amp.autocast("cuda"):\n    pass\n')


def test_deprecated_apis_called_with_positional_arguments_are_fixed_to_run(tmp_path, cli):
    # torch.cuda.amp.autocast(enabled, dtype, ...) but torch.amp.autocast(device_type, dtype,
    # enabled, ...): DINO's `autocast(fp16_scaler is not None)`, MoCo v3's `autocast(True)` once
    # became `autocast("cuda", True)` (dtype=True: a TypeError); custom_fwd(fn) (Mask R-CNN's
    # `nms = custom_fwd(_C.nms)`) became `custom_fwd(device_type="cuda", fn)`: a SyntaxError
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
    import torch
    from torch.cpu.amp import autocast as cpu_autocast

    def double(x):
        return 2 * x

    scaled = torch.cuda.amp.custom_fwd(double)
    cast = torch.cuda.amp.custom_fwd(double, cast_inputs=torch.float32)

    def run(x, amp):
        with cpu_autocast(amp, torch.bfloat16):
            inside = torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")
        with torch.cpu.amp.autocast(False):
            off = torch.is_autocast_enabled("cpu")
        return inside, off
    '''))
    assert cli("check", str(script), "--lint-only", "--fix").code == 0
    fixed = script.read_text()
    assert 'scaled = torch.amp.custom_fwd(double, device_type="cuda")' in fixed
    assert 'cast = torch.amp.custom_fwd(double, device_type="cuda", cast_inputs=torch.float32)' in fixed
    assert 'with cpu_autocast("cpu", enabled=amp, dtype=torch.bfloat16):' in fixed
    assert 'with torch.amp.autocast("cpu", enabled=False):' in fixed
    namespace: dict = {}
    exec(compile(fixed, str(script), "exec"), namespace)
    assert namespace["run"](torch.ones(1), True) == ((torch.bfloat16, True), False)
    assert namespace["run"](torch.ones(1), False)[0][1] is False


def test_deprecated_names_in_annotations_and_isinstance_are_fixed_with_the_calls(tmp_path, cli):
    # audiocraft's `self.scaler: tp.Optional[torch.cuda.amp.GradScaler] = None` was left as it
    # was while the call became torch.amp.GradScaler("cuda"): the finding the fix claimed came
    # back, and an isinstance() of the old class turned False on the scaler the fix builds
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
    import typing as tp
    import warnings

    import torch
    from torch.cuda.amp import GradScaler


    class Solver:
        def __init__(self) -> None:
            self.scaler: tp.Optional[torch.cuda.amp.GradScaler] = None
            with warnings.catch_warnings():  # no CUDA here: the scaler disables itself
                warnings.simplefilter("ignore")
                self.scaler = torch.cuda.amp.GradScaler()
                self.other: GradScaler = GradScaler()

        def check(self) -> bool:
            return isinstance(self.scaler, (torch.cuda.amp.GradScaler, int)) and isinstance(self.other, GradScaler)
    '''))
    result = cli("check", str(script), "--lint-only", "--fix", "--format", "json")
    assert [f for f in result.json()["findings"] if f["rule"] == "AMP401"] == []
    fixed = script.read_text()
    assert "self.scaler: tp.Optional[torch.amp.GradScaler] = None" in fixed
    assert "self.other: GradScaler = GradScaler(\"cuda\")" in fixed and "from torch.amp import GradScaler" in fixed
    assert "isinstance(self.scaler, (torch.amp.GradScaler, int))" in fixed
    namespace: dict = {}
    exec(compile(fixed, str(script), "exec"), namespace)
    assert namespace["Solver"]().check() is True


def test_mask_constant_fix_names_torch_as_the_file_binds_it(tmp_path, cli):
    # AMP414's fix wrote `torch.finfo(...)` into files that import torch as `th`, or only
    # `from torch import nn`: a NameError where the mask was filled
    aliased, unbound = tmp_path / "aliased.py", tmp_path / "unbound.py"
    aliased.write_text("import torch as th\n\n\ndef attend(s, m):\n    return s.masked_fill(m, -1e9)\n")
    unbound.write_text("from torch import nn\n\n\nclass A(nn.Module):\n"
                       "    def forward(self, s, m):\n        return s.masked_fill(m, -1e9)\n")
    result = cli("check", str(tmp_path), "--lint-only", "--fix", "--unsafe-fixes", "--format", "json")
    assert "return s.masked_fill(m, th.finfo(s.dtype).min)" in aliased.read_text()
    assert "-1e9" in unbound.read_text()  # no name for torch there: reported, not fixed
    assert [(Path(f["file"]).name, f["rule"]) for f in result.json()["findings"]] == [("unbound.py", "AMP414")]
    namespace: dict = {}
    exec(compile(aliased.read_text(), str(aliased), "exec"), namespace)
    filled = namespace["attend"](torch.zeros(2, dtype=torch.float16), torch.tensor([True, False]))
    assert filled.tolist() == [torch.finfo(torch.float16).min, 0.0]


def test_a_loss_scaler_updated_with_a_found_inf_flag_is_not_a_grad_scaler():
    # Megatron's mixed-precision optimizer (DeepSpeed-Domino): its own scaler unscales the main
    # grads by hand, is updated with the inf flag and has no step(); AMP405's unsafe fix wrote
    # `self.grad_scaler.step(self.optimizer)` - an AttributeError, or on None with bf16
    source = '''
    import torch
    class MixedPrecisionOptimizer:
        @torch.no_grad()
        def step(self):
            self._copy_model_grads_to_main_grads()
            if self.grad_scaler:
                found_inf_flag = self._unscale_main_grads_and_check_for_nan()
                self.grad_scaler.update(found_inf_flag)
                if found_inf_flag:
                    return False
            self.optimizer.step()
            return True
    '''
    assert _codes(source) == []


def test_framework_fixes_keep_the_arguments_the_framework_takes(tmp_path, cli):
    # AMP423 rewrote `clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)` into accelerate's
    # clip_grad_norm_(parameters, max_norm, norm_type), a TypeError; AMP424 dropped backward's
    # own arguments: `loss.backward(retain_graph=True)` became `self.manual_backward(loss)`
    import inspect

    accelerate = pytest.importorskip("accelerate")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent('''
    import lightning as L
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="fp16")

    def train(model, loss):
        accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, norm_type=2.0)
        torch.nn.utils.clip_grad_value_(model.parameters(), 1.0, foreach=True)

    class Net(L.LightningModule):
        def training_step(self, batch, batch_idx):
            loss = self.compute(batch)
            loss.backward (retain_graph=True)
            loss.backward()
    '''))
    cli("check", str(script), "--lint-only", "--fix", "--unsafe-fixes")
    fixed = script.read_text()
    assert "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)\n" in fixed
    assert "    accelerator.clip_grad_norm_(model.parameters(), max_norm=1.0, norm_type=2.0)\n" in fixed
    assert "    torch.nn.utils.clip_grad_value_(model.parameters(), 1.0, foreach=True)\n" in fixed
    assert "        self.manual_backward(loss, retain_graph=True)\n        self.manual_backward(loss)\n" in fixed
    # what was rewritten binds to accelerate's own signature
    inspect.signature(accelerate.Accelerator.clip_grad_norm_).bind(None, [], max_norm=1.0, norm_type=2.0)


@pytest.mark.parametrize("cast", [
    "model = model.half().float()",  # rounds the weights, trains in fp32
    "if mode == 'inference':\n            if use_amp:\n                model = model.half()\n"
    "            return evaluate(model)",
])
def test_half_casts_that_do_not_train_in_fp16(cast):
    source = f'''
    import torch
    def main(model, loader, mode, use_amp, evaluate):
        scaler = torch.amp.GradScaler("cuda")
        {cast}
        optimizer = torch.optim.Adam(model.parameters(), eps=1e-8)
        for x in loader:
            with torch.autocast("cuda"):
                loss = model(x).sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    '''
    assert _codes(source) == []


def test_a_half_model_that_trains_is_still_found():
    source = '''
    import torch
    def main(model, loader):
        scaler = torch.amp.GradScaler("cuda")
        model = model.half()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in loader:
            scaler.scale(model(x).sum()).backward()
            scaler.step(optimizer)
            scaler.update()
    '''
    assert _codes(source) == [("AMP410", 4), ("AMP411", 5)]


def test_framework_trainer_shapes_are_not_protocol_errors():
    # Shapes seen in large trainers (speechbrain, audiocraft, composer, fastai): the scaled loss
    # held in a variable, per-optimizer loops with one update after them, an update in another
    # method, and a `use_grad_scaling` switch.
    source = '''
    import torch
    from typing import cast
    class Brain:
        def fit_batch(self, batch, use_grad_scaling):
            loss = self.compute(batch)
            scaled_loss = self.scaler.scale(loss)
            scaled_loss.backward()
            held = cast(torch.Tensor, self.scaler.scale(loss))
            held.backward()
            for opt in self.optimizers:
                self.scaler.unscale_(opt)
            for opt in self.optimizers:
                torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], 1.0)
            for opt in self.optimizers:
                if use_grad_scaling:
                    self.scaler.step(opt)
                else:
                    opt.step()
            self.scaler.update()

        def before_step(self):
            self.scaler.step(self.opt)

        def after_step(self):
            self.learn.scaler.update()
    '''
    assert _codes(source) == []


def test_a_hand_unscaled_optimizer_beside_a_scaled_one_is_a_warning():
    source = '''
    import torch
    def weight_update(scaler, mlp_optimizer, embedding_optimizer):
        scaler.step(mlp_optimizer)
        scaler.unscale_(embedding_optimizer)
        embedding_optimizer.step()
        scaler.update()
    '''
    (found,) = lint_source("t.py", textwrap.dedent(source))
    assert (found.rule, found.line, found.severity.value) == ("AMP405", 6, "warning")


def test_backward_inside_an_uncalled_autocast_bound_to_a_name():
    source = '''
    from contextlib import nullcontext
    def step(self, loss_fn, batch, use_amp):
        ctx_mgr = self.accelerator.autocast if use_amp else nullcontext
        with ctx_mgr():
            loss = loss_fn(batch)
            self.accelerator.backward(loss)
    '''
    assert _codes(source) == [("AMP408", 7)]


@pytest.mark.parametrize("params", [
    "model.parameters()", "get_trainable_params(model)", "filter(lambda p: p.requires_grad, model.parameters())",
    '[{"params": model.parameters(), "lr": 1e-3}]',
])
def test_parameters_through_a_helper_are_the_models(params):
    source = f'''
    import torch
    def main(model, loader, get_trainable_params):
        model = model.half()
        optimizer = torch.optim.Adam({params}, eps=1e-8)
        for x in loader:
            model(x).sum().backward()
            optimizer.step()
    '''
    assert ("AMP412", 5) in _codes(source)
