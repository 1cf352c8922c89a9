"""Naming a model without writing a wrapper: PATH:EXPR, module.path:NAME_OR_EXPR and hf:MODEL_TYPE,
for `ampaudit check` and `ampaudit convert`, and their one-line errors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ampaudit.core.errors import UsageError
from ampaudit.load.loader import NotImported, load_target
from ampaudit.load.spec import ModelSpec, parse_spec
from tests.conftest import model

CONFIGURED = model("configured.py")
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")


@pytest.mark.parametrize(("text", "expected"), [
    ("model.py", ModelSpec("model.py", "file", Path("model.py"))),
    ("model.py:Net", ModelSpec("model.py:Net", "file", Path("model.py"), name="Net")),
    ("m.py:GPT(GPTConfig(n_layer=2))", ModelSpec("m.py:GPT(GPTConfig(n_layer=2))", "file", Path("m.py"),
                                                 expr="GPT(GPTConfig(n_layer=2))")),
    ("m.py:configs.small", ModelSpec("m.py:configs.small", "file", Path("m.py"), expr="configs.small")),
    ("m.py:make({'a': 1})", ModelSpec("m.py:make({'a': 1})", "file", Path("m.py"), expr="make({'a': 1})")),
    ("C:/x/model.py", ModelSpec("C:/x/model.py", "file", Path("C:/x/model.py"))),
    ("torch.nn:Linear", ModelSpec("torch.nn:Linear", "module", module="torch.nn", name="Linear")),
    ("torch.nn:Linear(4, 4)", ModelSpec("torch.nn:Linear(4, 4)", "module", module="torch.nn", expr="Linear(4, 4)")),
    ("pkg.mod:f({'k': 1})", ModelSpec("pkg.mod:f({'k': 1})", "module", module="pkg.mod", expr="f({'k': 1})")),
    ("hf:gpt2", ModelSpec("hf:gpt2", "hf", module="gpt2")),
])
def test_parse_spec(text, expected):
    assert parse_spec(text) == expected


def test_a_name_is_an_identifier_anything_else_must_be_an_expression():
    with pytest.raises(UsageError, match=r"'GPT\(' is neither a name nor a Python expression"):
        parse_spec("m.py:GPT(")


def _check(cli, *args):
    result = cli("check", *args, "--format", "json")
    assert "Traceback" not in result.err
    return result


def _one_line_error(result, words):
    assert result.code == 2 and result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ampaudit: error: "), result.err
    assert words in lines[0], lines[0]


# --- PATH:EXPR ---------------------------------------------------------------------------------


def test_path_expr_builds_the_model_from_an_expression(cli):
    result = _check(cli, f'{CONFIGURED}:GPT(GPTConfig(n_layer=2, n_embd=32))')
    assert result.code == 0, result.err
    report = result.json()
    assert report["target"]["entry"] == "GPT(GPTConfig(n_layer=2, n_embd=32))"
    assert report["target"]["trace"] == "fx"
    blocks = {n["module"].split(".")[1] for n in report["nodes"] if (n["module"] or "").startswith("blocks.")}
    assert blocks == {"0", "1"}  # n_layer=2 took effect (the default is 4)
    assert any("example_inputs()" in note for note in report["target"]["notes"])  # the file's inputs


def test_without_a_name_the_configured_model_says_how_to_name_it(cli):
    result = _check(cli, CONFIGURED)
    assert result.code == 0
    [finding] = result.json()["findings"]
    assert finding["rule"] == "AMP005"
    assert f'name it with an expression: {CONFIGURED}:"GPT(...)"' in finding["message"]


def test_path_name_keeps_working(cli):
    result = _check(cli, f"{model('named_entries.py')}:tiny", "--input-shape", "2,4")
    assert result.code == 0 and result.json()["target"]["entry"] == "tiny()"


@pytest.mark.parametrize(("selector", "words"), [
    ("GPT(", "'GPT(' is neither a name nor a Python expression"),
    ("GPT(Config())", "GPT(Config()) (in fixtures/models/configured.py) raised NameError: name 'Config' is not"),
    ("VOCAB_SIZE", "VOCAB_SIZE is int, not an nn.Module"),
    ("GPTConfig()", "GPTConfig() is GPTConfig, not an nn.Module"),
    ("GPT", "GPT() needs arguments (config)"),
])
def test_a_bad_expression_is_one_line_and_exit_2(cli, selector, words):
    _one_line_error(_check(cli, f"{CONFIGURED}:{selector}"), words)


def test_an_expression_on_a_file_that_runs_code_is_not_imported(cli, tmp_path):
    path = tmp_path / "script.py"
    path.write_text("from torch import nn\n\nclass Net(nn.Module):\n    def __init__(self, d):\n"
                    "        super().__init__()\n        self.fc = nn.Linear(d, d)\n\n"
                    "    def forward(self, x):\n        return self.fc(x)\n\nprint('training')\n")
    result = _check(cli, f"{path}:Net(4)")
    assert result.code == 0 and [f["rule"] for f in result.json()["findings"]] == ["AMP003"]
    assert result.json()["target"]["entry"] == "Net(4)"
    result = _check(cli, f"{path}:Net(4)", "--exec", "--input-shape", "2,4")
    assert result.code == 0 and result.json()["target"]["trace"] == "fx"


# --- module.path:NAME_OR_EXPR --------------------------------------------------------------------


def test_module_expr(cli):
    result = _check(cli, "torch.nn:Linear(4, 4)", "--input-shape", "2,4")
    assert result.code == 0, result.err
    report = result.json()
    assert (report["target"]["file"], report["target"]["entry"], report["target"]["trace"]) == (
        "torch.nn", "Linear(4, 4)", "fx")
    assert [n["kind"] for n in report["nodes"] if n["op"].startswith("call")] == ["linear"]
    assert report["nodes"][1]["measured"] is not None  # ran on the --input-shape inputs


def test_module_name_of_a_no_argument_class(cli):
    result = _check(cli, "torch.nn:Identity")
    assert result.code == 0 and result.json()["target"]["entry"] == "Identity()"


@pytest.mark.parametrize(("spec", "words"), [
    ("no_such_package_xyz:Net", "cannot import no_such_package_xyz: no module named 'no_such_package_xyz'"),
    ("torch.nn:Linear", 'Linear() needs arguments (in_features, out_features)'),
    ("torch.nn:Nope", "torch.nn defines no top-level 'Nope'"),
    ("torch.nn:Nope(1)", "Nope(1) (in torch.nn) raised NameError"),
    ("torch.nn:Linear(4)", "Linear(4) (in torch.nn) raised TypeError"),
])
def test_module_errors(cli, spec, words):
    _one_line_error(_check(cli, spec), words)


@needs_transformers
def test_module_expr_of_a_transformers_model_gets_token_ids(cli):
    result = _check(cli, "transformers:GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, "
                         "vocab_size=100, n_positions=16))")
    assert result.code in (0, 1), result.err
    report = result.json()
    assert report["target"]["file"] == "transformers"  # a lazy module: its names resolve on demand
    assert any("token ids 2x8, the default for a language model" in note for note in report["target"]["notes"])
    assert any(n["measured"] for n in report["nodes"])


@pytest.mark.parametrize(("package", "spec"), [
    ("torchvision", "torchvision.models:resnet18"),
    ("timm", "timm:create_model('resnet18')"),
])
def test_vision_packages_when_installed(cli, package, spec):
    pytest.importorskip(package)
    result = _check(cli, spec, "--no-run")
    assert result.code in (0, 1), result.err
    assert result.json()["target"]["trace"] in ("fx", "fx-partial")


# --- hf:MODEL_TYPE -----------------------------------------------------------------------------


@needs_transformers
def test_hf_gpt2_with_config_overrides(cli):
    result = _check(cli, "hf:gpt2", "--config", "n_layer=1", "--config", "activation_function=relu")
    assert result.code in (0, 1), result.err
    report = result.json()
    assert report["target"]["file"] == "hf:gpt2"
    assert report["target"]["entry"].startswith("GPT2LMHeadModel(GPT2Config(activation_function='relu', ")
    assert "n_layer=1" in report["target"]["entry"]
    assert any("token ids 2x8" in note for note in report["target"]["notes"])
    assert {n["module"].split(".")[2] for n in report["nodes"]
            if (n["module"] or "").startswith("transformer.h.")} == {"0"}


@needs_transformers
@pytest.mark.parametrize(("model_type", "head"), [
    ("llama", "LlamaForCausalLM"), ("bert", "BertForMaskedLM"), ("t5", "T5ForConditionalGeneration"),
    # GPT-J's rotary dims (default 64) exceeded the small 16-dim heads: its default inputs failed to
    # run; Falcon's head_dim is a read-only property: setting it raised before the model was built
    ("gptj", "GPTJForCausalLM"), ("falcon", "FalconForCausalLM"),
    # XLNet's max_position_embeddings has a setter that refuses any value (NotImplementedError):
    # "hf:xlnet: building XLNetConfig(...) raised NotImplementedError"; its d_inner was 4096
    ("xlnet", "XLNetLMHeadModel"),
    # DeepSeek-V3's rotary dims (qk_rope_head_dim 64) disagreed with the small head_dim 16: its
    # default inputs failed to run ("no inputs"), and it had 256 experts of width 2048
    ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_hf_types_build_small_with_inputs_that_run(model_type, head):
    loaded = load_target(f"hf:{model_type}")
    assert loaded.entry.startswith(head + "(")
    assert sum(p.numel() for p in loaded.model.parameters()) < 100_000
    assert loaded.inputs is not None and "input_ids" in loaded.inputs.kwargs and not loaded.notes
    if model_type == "t5":
        assert "decoder_input_ids" in loaded.inputs.kwargs
    assert not loaded.model.training


@needs_transformers
def test_funnel_builds_though_its_layer_count_cannot_be_set():
    # Funnel's num_hidden_layers is the sum of its block_sizes, and its setter refuses any value
    loaded = load_target("hf:funnel")
    assert loaded.entry.startswith("FunnelForMaskedLM(FunnelConfig(d_inner=64, d_model=32, n_head=2, ")
    assert "num_hidden_layers" not in loaded.entry and loaded.inputs is not None and not loaded.notes


@needs_transformers
@pytest.mark.parametrize(("model_type", "head", "inputs"), [
    ("whisper", "WhisperForConditionalGeneration", {"input_features": (2, 16, 32), "decoder_input_ids": (2, 8)}),
    ("vit", "ViTForImageClassification", {"pixel_values": (2, 3, 32, 32)}),
    # transformers maps DeiT to two heads (a tuple, which was called: "'tuple' object is not callable")
    ("deit", "DeiTForImageClassification", {"pixel_values": (2, 3, 32, 32)}),
    # Segformer's num_attention_heads is a list per stage: the small config's 2 failed its validation
    ("segformer", "SegformerForImageClassification", {"pixel_values": (2, 3, 224, 224)}),
    # a model in stages got the small config's numbers only where they fit: a full-size ResNet-50
    ("resnet", "ResNetForImageClassification", {"pixel_values": (2, 3, 224, 224)}),
    # ConvNeXt's stages halve a 32-pixel image after an 8x stem to nothing: its own 4x stem kept
    ("convnext", "ConvNextForImageClassification", {"pixel_values": (2, 3, 32, 32)})])
def test_hf_types_build_the_model_people_train(model_type, head, inputs):
    # hf:whisper built WhisperForCausalLM (the text decoder alone) and hf:vit the bare ViTModel:
    # now the speech seq2seq model and the image classifier, with inputs that run them
    import torch

    loaded = load_target(f"hf:{model_type}")
    assert type(loaded.model).__name__ == head and loaded.entry.startswith(head + "(")
    assert sum(p.numel() for p in loaded.model.parameters()) < 100_000  # ResNet-50's own size: 23.5M
    assert {k: tuple(v.shape) for k, v in loaded.inputs.kwargs.items()} == inputs
    with torch.no_grad():
        out = loaded.model(**loaded.inputs.kwargs)
    assert out.logits.shape[0] == 2


@needs_transformers
@pytest.mark.parametrize(("args", "words"), [
    (["hf:gpt3"], "hf:gpt3: unknown transformers model type (did you mean"),
    (["hf:no-such-type"], "hf:no-such-type: unknown transformers model type"),
    (["hf:gpt2", "--config", "n_layers=2"],
     "--config n_layers: GPT2Config has no field 'n_layers' (did you mean n_layer"),
    (["hf:gpt2", "--config", "n_layer"], "--config 'n_layer': expected KEY=VALUE"),
    (["hf:gpt2", "--config", "n_head=3"], "hf:gpt2: building GPT2Config("),
    ([CONFIGURED, "--config", "n_layer=2"], "--config KEY=VALUE sets fields of an hf:MODEL_TYPE model's config"),
    (["hf:gpt2", CONFIGURED], "hf:gpt2 names a model, not a file: check it on its own"),
    (["hf:gpt2", "--lint-only"], "hf:gpt2 names a model, not a file"),
])
def test_hf_errors(cli, args, words):
    _one_line_error(_check(cli, *args), words)


def test_hf_without_transformers_is_a_clear_error(cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    _one_line_error(_check(cli, "hf:gpt2"), "hf:gpt2 needs transformers: pip install transformers")


# --- convert -----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [f"{CONFIGURED}:GPT(GPTConfig(n_layer=1, n_embd=32))",
                                  "torch.nn:Sequential(Linear(4, 8), ReLU(), Linear(8, 2))"])
def test_convert_takes_the_same_targets(cli, tmp_path, spec):
    args = ["--input-shape", "2,4"] if spec.startswith("torch.nn") else []
    result = cli("convert", spec, "-o", tmp_path / "out", *args, "--no-verify", "--train-steps", "0")
    assert result.code == 0, result.err
    assert (tmp_path / "out" / "plan.json").exists()


@needs_transformers
def test_convert_hf(cli, tmp_path):
    result = cli("convert", "hf:gpt2", "--config", "n_layer=1", "-o", tmp_path / "out", "--no-verify")
    assert result.code == 0, result.err
    assert "hf:gpt2" in result.out and (tmp_path / "out" / "plan.json").exists()


def test_load_target_of_an_expression_respects_the_import_guard(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("from torch import nn\n\nmodel = nn.Linear(2, 2)\nfor _ in range(3):\n    pass\n")
    assert isinstance(load_target(f"{path}:nn.Linear(3, 3)"), NotImported)
    assert load_target(f"{path}:nn.Linear(3, 3)", allow_exec=True).entry == "nn.Linear(3, 3)"


def test_a_model_that_starts_with_an_embedding_gets_token_ids(cli):
    result = _check(cli, "torch.nn:Sequential(Embedding(10, 4), Linear(4, 2))")
    assert result.code == 0, result.err
    notes = result.json()["target"]["notes"]
    assert any("token ids 2x8, the default for a model that starts with an Embedding" in n for n in notes)


def test_default_inputs_that_fail_are_dropped_with_a_note(cli):
    # Starts with a Conv2d taking 3 channels; the Linear after it cannot take the flattened images.
    result = _check(cli, "torch.nn:Sequential(Conv2d(3, 2, 3), Flatten(), Linear(4, 2))")
    assert result.code in (0, 1), result.err
    report = result.json()
    assert any("the default example inputs (images 1x3x224x224" in n and "pass --input-shape" in n
               for n in report["target"]["notes"])
    assert report["target"]["trace"] == "fx"


def test_library_lines_show_the_file_name_in_the_terminal_table():
    from ampaudit.core.findings import Report, Target
    from ampaudit.report.terminal import _where

    report = Report(Target("hf:gpt2", "GPT2LMHeadModel(...)", "recorder", []), "float16", [], [])
    path = "/usr/lib/python3/site-packages/transformers/models/gpt2/modeling_gpt2.py"
    assert _where(path, 254, report) == "modeling_gpt2.py:254"
    assert _where("fixtures/models/layers.py", 3, report) == "fixtures/models/layers.py:3"
    assert _where("hf:gpt2", 3, report) == "3"


@needs_transformers
@pytest.mark.parametrize(("model_type", "head"), [("clip", "CLIPModel"), ("siglip", "SiglipModel")])
def test_hf_text_image_models_build_small_towers_with_both_inputs_and_their_loss(model_type, head):
    # the small config reached neither tower (a 151M-parameter CLIP) and the default inputs were
    # token ids alone, which SigLIP's forward cannot run
    import torch

    loaded = load_target(f"hf:{model_type}")
    assert type(loaded.model).__name__ == head and not loaded.notes
    assert sum(p.numel() for p in loaded.model.parameters()) < 100_000
    kwargs = loaded.inputs.kwargs
    assert (tuple(kwargs["input_ids"].shape), tuple(kwargs["pixel_values"].shape), kwargs["return_loss"]) == \
        ((2, 8), (2, 3, 32, 32), True)
    with torch.no_grad():
        out = loaded.model(**kwargs)
    assert out.loss.numel() == 1 and torch.isfinite(out.loss)


@needs_transformers
def test_a_speech_model_gets_raw_audio(cli):
    # wav2vec2's main input is input_values: without a default the graph audit had no inputs,
    # measured nothing and convert ran no training check
    result = _check(cli, "hf:wav2vec2")
    assert result.code == 0, result.err
    report = result.json()
    assert any("raw audio 2x1600, the default for a speech model" in note for note in report["target"]["notes"])
    assert sum(1 for n in report["nodes"] if n["measured"]) > 20
    assert not [f for f in report["findings"] if f["rule"] in ("AMP002", "AMP102")]  # broadcast_to is catalogued


@needs_transformers
def test_hf_swin_runs_on_its_default_images(cli):
    # Swin's window (7) was wider than the small config's 4x4 patches: "the default example inputs
    # fail to run the model", five AMP002 and nothing measured
    result = _check(cli, "hf:swin")
    assert result.code == 0, result.err
    report = result.json()
    assert not any("fail to run" in note for note in report["target"]["notes"])
    assert sum(1 for n in report["nodes"] if n["measured"]) > 20 and report["target"]["trace"] == "recorder"
