"""Models under the old ``torch.nn.utils.weight_norm`` (HiFi-GAN, VITS, BigVGAN), whose weight is
an attribute its hook computes: graph.model_copy copies them where ``copy.deepcopy`` refuses (and
spectral_norm's after a training forward), convert converts them, check measures their Linear."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import ampaudit
from ampaudit.graph.model_copy import copy_model
from ampaudit.load.loader import load_target
from tests.conftest import model

warnings.filterwarnings("ignore", message=".*weight_norm.*is deprecated", category=FutureWarning)


def _vocoder():
    loaded = load_target(model("weight_norm_vocoder.py"))
    return loaded.model, loaded.inputs.args


def _computed(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each module's tensor attributes with autograd history, by module and attribute name."""
    return {f"{name}.{attr}": value for name, m in module.named_modules() for attr, value in vars(m).items()
            if isinstance(value, torch.Tensor) and value.grad_fn is not None}


def test_a_weight_normed_model_is_copied_where_deepcopy_refuses():
    vocoder, args = _vocoder()
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(vocoder)
    before = _computed(vocoder)
    assert len(before) == 6  # proj, pre, up, two res convs, post
    twin = copy_model(vocoder)
    assert all(_computed(vocoder)[k] is v for k, v in before.items())  # the user's model keeps its own
    assert not set(map(id, twin.parameters())) & set(map(id, vocoder.parameters()))
    with torch.no_grad():
        assert torch.equal(twin(*args), vocoder(*args))
    twin.pre.weight_v.data.mul_(2.0)  # weight_norm: g sets the norm, v only the direction
    twin.pre.weight_g.data.mul_(3.0)
    with torch.no_grad():
        assert not torch.equal(twin(*args), vocoder(*args))


def test_spectral_norm_after_a_training_forward_is_copied():
    net = nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 8)), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    net(x).sum().backward()  # training mode: the power iteration leaves weight with history
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(net)
    twin = copy_model(net).eval()
    with torch.no_grad():
        assert torch.equal(twin(x), net.eval()(x))


@pytest.mark.parametrize("backend", ["fx", "modules"])
def test_convert_takes_a_weight_normed_vocoder(backend):
    vocoder, args = _vocoder()
    state = {k: v.clone() for k, v in vocoder.state_dict().items()}
    mp = ampaudit.convert(vocoder, args, backend=backend)
    with torch.no_grad():
        ref, out = vocoder(*args), mp(*args)
    assert out.dtype == torch.float32
    assert float((out - ref).norm() / ref.norm()) < 1e-2
    assert all(torch.equal(v, vocoder.state_dict()[k]) for k, v in state.items())  # never touch the user's model


def test_cli_convert_exports_a_weight_normed_vocoder(cli, tmp_path):
    out = tmp_path / "converted"
    result = cli("convert", model("weight_norm_vocoder.py"), "--train-steps", "4", "-o", out)
    assert result.code == 0, result.err
    assert "loaded back with ampaudit.apply" in result.out
    assert sorted(p.name for p in out.iterdir()) == ["ampaudit-export.json", "module.py", "plan.json",
                                                      "weights.safetensors"]


def test_check_measures_a_weight_normed_linear(cli):
    result = cli("check", model("weight_norm_vocoder.py"), "--format", "json")
    assert result.code == 0, result.err
    report = json.loads(result.out)
    assert report["findings"] == [] and report["summary"]["fp16"] == 6  # the Linear and the five convs
    proj = next(n for n in report["nodes"] if n["name"] == "proj")
    assert (proj["kind"], proj["precision"], proj["line"]) == ("linear", "fp16", 39)
    assert 0 < proj["measured"]["rel_error"] < 1e-3  # float16's rounding of the weight its hook computes


def test_the_emitted_torchao_file_copies_a_weight_normed_model(cli, tmp_path):
    pytest.importorskip("torchao.float8")
    out = tmp_path / "out"
    result = cli("convert", f"{model('weight_norm_vocoder.py')}:fp8_model", "--dtype", "fp8", "--emit", "torchao",
                 "--fp8-recipe", "tensorwise", "--train-steps", "4", "-o", out)
    assert result.code == 0, result.err
    run = subprocess.run([sys.executable, str(out / "fp8_torchao.py")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]  # its verify() deep-copies the model twice
    assert run.stdout.strip().startswith("tensorwise: 0 layer(s) kept in bf16; 4 steps")


def test_fp8_keeps_a_linear_whose_weight_is_computed_in_bf16(cli):
    # torchao's Float8Linear.from_float takes the weight as a Parameter: on this model
    # convert_to_float8_training raised "cannot assign 'torch.FloatTensor' as parameter 'weight'",
    # and the audit said fp8 (and read weight.grad of a non-leaf, with torch's warning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        result = cli("check", model("weight_norm_vocoder.py"), "--dtype", "fp8", "--format", "json")
    assert result.code == 1, result.err  # a warning
    (found,) = [f for f in json.loads(result.out)["findings"] if f["rule"] == "AMP706"]
    assert found["module"] == "proj" and "computed by torch.nn.utils.weight_norm" in found["message"]


def test_fp8_names_a_parametrization_that_computes_the_weight():
    net = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 16))
    policy = ampaudit.fp8_policy(net, (torch.randn(4, 16),), recipe="tensorwise")
    assert policy.fp8 == ["2"]
    assert policy.keep == {"0": "AMP706: its weight is computed by a parametrization (WeightNorm): torchao's "
                                "Float8Linear takes a Parameter"}


class _Untraceable(torch.nn.Module):
    """DAC's shape: weight-normed convs in a forward fx cannot trace, so the recording runs
    weight_norm's pre-hook and sees its ``torch._weight_norm``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.utils.weight_norm(torch.nn.Conv1d(2, 4, 3, padding=1))

    def forward(self, x):
        return self.conv(x) if x.shape[-1] > 1 else x


def test_the_recorded_weight_norm_is_a_catalogued_fp32_op():
    # descript-audio-codec: seven AMP102 "torch._weight_norm is not in the op catalog" infos
    from ampaudit.check.api import check

    report = check(_Untraceable(), example_inputs=(torch.randn(1, 2, 8),), dtype=torch.float16)
    assert "AMP102" not in {f.rule for f in report.findings}
    assert [n.precision.value for n in report.nodes if n.kind == "_weight_norm"] == ["fp32"]
