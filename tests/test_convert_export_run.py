"""An export is loaded back (``ampaudit.apply`` on the staged folder) and run on the example
inputs before it is written: one that raises is never published."""

from __future__ import annotations

from ampaudit.convert.publish import MANIFEST
from tests.conftest import line_of, model


def _text(out: str) -> str:
    return " ".join(word for word in out.split() if word != "│")


def test_an_export_whose_forward_raises_is_never_written(cli, tmp_path):
    # converted per module without verification, the model's own dtype check raises in the
    # converted forward: before, the export was written (exit 0) and raised on first use
    out = tmp_path / "out"
    result = cli("convert", model("fp32_only_head.py"), "-o", out, "--no-verify")
    assert result.code == 1 and not out.exists()
    line = line_of(model("fp32_only_head.py"), "raise TypeError")
    assert result.err == ("ampaudit: error: the export fails on its example inputs, loaded back with ampaudit.apply: "
                          "TypeError: the head expects float32 features, got torch.float16 "
                          f"(fixtures/models/fp32_only_head.py:{line}); nothing was written to {out}\n")
    # an earlier export in OUT_DIR stays as it was
    assert cli("convert", model("input_shape.py"), "-o", out, "--input-shape", "2,8", "--train-steps", "0").code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert cli("convert", model("fp32_only_head.py"), "-o", out, "--no-verify").code == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and MANIFEST in before


def test_the_summary_says_whether_the_export_was_run(cli, tmp_path):
    result = cli("convert", model("input_shape.py"), "-o", tmp_path / "a")
    assert result.code == 0
    assert "export run NOT RUN: no example inputs (define example_inputs() or give --input-shape to run the " \
           "export before it is written)" in _text(result.out)
    result = cli("convert", model("input_shape.py"), "-o", tmp_path / "b", "--input-shape", "2,8")
    assert result.code == 0
    assert "export run loaded back with ampaudit.apply and run on the example inputs" in _text(result.out)


def test_a_child_traced_with_a_defaulted_argument_is_traced_again_so_by_apply(cli, tmp_path):
    # lucidrains' ResnetBlock (einops: not traceable) calls self.block2(h), scale_shift left
    # None: convert traced block2 with scale_shift fixed to None (from the recorded call), but
    # apply, which has no example inputs, traced it with scale_shift a graph input - "plan.json
    # was made for another model" and the export, which ran, was never written (exit 1)
    import json

    import torch

    import ampaudit
    from fixtures.models import ddpm_unet

    out = tmp_path / "out"
    result = cli("convert", f"{model('ddpm_unet.py')}:einops_model", "-o", out, "--backend", "fx",
                 "--train-steps", "0")
    assert result.code == 0, result.err
    fixed = json.loads((out / "plan.json").read_text())["summary"]["fixed_args"]
    assert fixed["downs.0.0.block2"] == {"scale_shift": None}
    net, inputs = ddpm_unet.einops_model(), ddpm_unet.example_inputs()
    applied = ampaudit.apply(net, out)
    with torch.no_grad():
        expected = net(*inputs)
        assert float((applied(*inputs) - expected).norm() / expected.norm()) < 1e-2


def test_a_child_called_by_keyword_with_specialised_arguments_takes_them_by_name(cli, tmp_path):
    # BertModel calls self.embeddings(input_ids=..., position_ids=None, ...): traced with those
    # arguments specialised, the child's forward named them position_ids_1 and the parent's
    # call raised "unexpected keyword argument 'position_ids'" (hf:bert --backend fx: exit 1)
    import inspect

    import ampaudit
    from fixtures.models import keyword_children

    out = tmp_path / "out"
    result = cli("convert", model("keyword_children.py"), "-o", out, "--backend", "fx", "--train-steps", "2")
    assert result.code == 0, result.err
    net = keyword_children.get_model()
    applied = ampaudit.apply(net, out)
    parameters = inspect.signature(applied.embeddings.forward).parameters
    assert list(parameters) == ["input_ids", "token_type_ids", "position_ids", "inputs_embeds",
                                "past_key_values_length"]
    # and its non-persistent buffer, which the traced forward reads, is still not in the
    # state_dict (BERT's position_ids and token_type_ids became keys: 46 for 44)
    assert list(applied.state_dict()) == list(net.state_dict())


def test_a_parent_reads_plain_attributes_of_its_converted_children(cli, tmp_path):
    # transformers' Whisper encoder (not traceable) computes its input length from
    # self.conv1.stride: the converted Conv1d (a GraphModule) had no stride and the converted
    # model failed to run (hf:whisper --backend fx: exit 2)
    import torch

    import ampaudit
    from fixtures.models import conv_stride_encoder

    out = tmp_path / "out"
    result = cli("convert", model("conv_stride_encoder.py"), "-o", out, "--backend", "fx", "--train-steps", "2")
    assert result.code == 0, result.err
    net, (features,) = conv_stride_encoder.get_model(), conv_stride_encoder.example_inputs()
    applied = ampaudit.apply(net, out)
    assert isinstance(applied.conv2, torch.fx.GraphModule) and applied.conv2.stride == (2,)
    with torch.no_grad():
        expected = net(features)
        assert float((applied(features) - expected).norm() / expected.norm()) < 1e-2


def test_an_export_holding_a_non_persistent_buffer_still_applies(cli, tmp_path):
    # exports made before 31b0319 saved BERT's non-persistent position_ids through fx: apply
    # refused them ("does not fit this model: unexpected [...position_ids]")
    from safetensors import safe_open
    from safetensors.torch import save_file

    import ampaudit
    from fixtures.models import keyword_children

    out = tmp_path / "out"
    assert cli("convert", model("keyword_children.py"), "-o", out, "--backend", "fx", "--train-steps", "0").code == 0
    weights = out / "weights.safetensors"
    with safe_open(str(weights), "pt") as fh:
        tensors, metadata = {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118
    net = keyword_children.get_model()
    tensors["embeddings.position_ids"] = net.embeddings.position_ids.clone()
    save_file(tensors, str(weights), metadata=metadata)
    applied = ampaudit.apply(net, out)
    assert list(applied.state_dict()) == list(net.state_dict())


_FIXED_LENGTH = '''import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, idx):
        if idx.shape[1] != 16:
            raise ValueError(f"expects 16 tokens, got {idx.shape[1]}")
        return self.fc(self.emb(idx))
'''


def test_convert_says_why_the_default_inputs_did_not_run(cli, tmp_path):
    # a model named by an expression gets default inputs from its type (token ids 2x8 here);
    # where they fail, check said why in a note and convert dropped it: its summary said only
    # "export run NOT RUN: no example inputs (define example_inputs() or give --input-shape ...)"
    # (hf:mamba2 --config num_heads=4: its 8 groups of 4 heads fail on repeat_interleave)
    (tmp_path / "m.py").write_text(_FIXED_LENGTH)
    out = tmp_path / "out"
    result = cli("convert", f"{tmp_path / 'm.py'}:Net()", "-o", out)
    assert result.code == 0
    note = ("note the default example inputs (token ids 2x8, the default for a model that starts with an Embedding) "
            "fail to run the model (ValueError: expects 16 tokens, got 8")
    assert note in _text(result.out)
    plan = __import__("json").loads((out / "plan.json").read_text())
    assert plan["summary"]["notes"][0].startswith("the default example inputs (token ids 2x8, the default for a "
                                                  "model that starts with an Embedding) fail to run the model "
                                                  "(ValueError: expects 16 tokens, got 8 (")
    fp8 = cli("convert", f"{tmp_path / 'm.py'}:Net()", "-o", tmp_path / "fp8", "--dtype", "fp8", "--emit", "torchao")
    assert fp8.code == 2 and fp8.err.startswith(
        "ampaudit: error: an fp8 policy is measured on the model's example inputs: define example_inputs() or give "
        "--input-shape (the default example inputs (token ids 2x8, the default for a model that starts with an "
        "Embedding) fail to run the model (ValueError: expects 16 tokens, got 8 (")
