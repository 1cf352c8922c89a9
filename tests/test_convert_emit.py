"""--emit: the plan as policies for torch.autocast, transformers and FSDP2, each run for real."""

from __future__ import annotations

import importlib.util
import os
import socket
import sys

import pytest
import torch

import ampaudit
from ampaudit.load.loader import load_target
from tests.conftest import model

FIXTURE = "mask_overflow_attention.py"


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: torch.compile looks functions' modules up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    from ampaudit.cli.main import main

    out = tmp_path_factory.mktemp("emit") / "out"
    assert main(["convert", model(FIXTURE), "-o", str(out), "--emit", "autocast", "--emit", "hf", "--emit",
                 "fsdp2", "--train-steps", "0"]) == 0
    return out


def test_emit_writes_each_policy_with_the_plans_fp32_modules(export):
    assert {p.name for p in export.iterdir()} >= {"autocast_policy.py", "hf_keep_in_fp32.py", "fsdp2_policy.py"}
    assert _module(export / "autocast_policy.py", "autocast_policy").FP32_MODULES == ["attn"]
    hf = _module(export / "hf_keep_in_fp32.py", "hf_keep")
    assert hf.KEEP_IN_FP32 == ["attn"] and hf.FP32_MODULES == ["attn"]
    fsdp2 = _module(export / "fsdp2_policy.py", "fsdp2_names")
    # fp16 units: the modules whose every op computes in fp16; attn's fill stays fp32 outside them
    assert fsdp2.LOW_MODULES == ["inp", "attn.q", "attn.k", "out"] and fsdp2.FP32_MODULES == ["attn"]


@pytest.mark.slow  # inductor compiles C++ for the CPU: the real compiler, end to end
def test_autocast_policy_under_torch_compile_without_graph_breaks(export):
    # the emitted file (torch only) and ampaudit.autocast_policy do the same; inductor on the CPU
    from torch._dynamo.utils import counters

    loaded = load_target(model(FIXTURE))
    (x,) = loaded.inputs.args
    plain = loaded.model
    policy = _module(export / "autocast_policy.py", "autocast_policy_compiled")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = plain(x)
    assert ampaudit.autocast_policy(plain, export) == ["attn"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = plain(x)
    assert eager.dtype == torch.bfloat16 and float((eager.float() - before.float()).abs().max()) > 0  # attn in fp32
    other = load_target(model(FIXTURE)).model
    other.load_state_dict(loaded.model.state_dict())
    policy.apply(other)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(other, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = compiled(x)
    assert not counters["graph_break"]
    assert torch.allclose(out.float(), eager.float(), atol=2e-2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_policy_shards_and_runs(export, monkeypatch):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(model(FIXTURE))))
        policy = _module(export / "fsdp2_policy.py", "fsdp2_policy")
        loaded = load_target(model(FIXTURE))
        reference = load_target(model(FIXTURE)).model
        reference.load_state_dict(loaded.model.state_dict())
        assert policy.shard(loaded.model) == ["inp", "attn.q", "attn.k", "out"]
        (x,) = loaded.inputs.args
        out = loaded.model(x)
        assert out.dtype == torch.float32  # the units' outputs come back in fp32
        expected = reference(x)
        assert float((out.float() - expected).norm() / expected.norm()) < 1e-2
    finally:
        sys.path.pop(0)
        dist.destroy_process_group()


def test_autocast_policy_survives_a_deep_copy(export):
    # the fp32 wrapper is bound to its module, so a copy of the model (an EMA, say) runs its
    # own attention, not the original's
    import copy

    loaded = load_target(model(FIXTURE))
    ampaudit.autocast_policy(loaded.model, export)
    twin = copy.deepcopy(loaded.model)
    with torch.no_grad():
        twin.attn.q.weight.zero_()
    (x,) = loaded.inputs.args
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not torch.equal(twin(x), loaded.model(x))


def test_an_override_in_the_roots_own_forward_is_kept_by_the_autocast_policy(tmp_path):
    # root_mask_fill.py fills fp16 scores with -1e9 in the model's own forward: its plan record
    # names no module. The policies listed nothing, and plain autocast raised as before.
    from ampaudit.cli.main import main

    out = tmp_path / "out"
    assert main(["convert", model("root_mask_fill.py"), "-o", str(out), "--emit", "autocast", "--emit", "hf",
                 "--train-steps", "0"]) == 0
    policy = _module(out / "autocast_policy.py", "autocast_policy_root")
    assert policy.FP32_MODULES == [""]
    hf = _module(out / "hf_keep_in_fp32.py", "hf_keep_root")
    assert hf.KEEP_IN_FP32 == [] and "NOT EXPRESSIBLE HERE" in hf.__doc__
    loaded = load_target(model("root_mask_fill.py"))
    (x,) = loaded.inputs.args
    expected = loaded.model(x)
    with torch.autocast("cpu", dtype=torch.float16), pytest.raises(RuntimeError, match="overflow"):
        loaded.model(x)
    policy.apply(loaded.model)
    with torch.autocast("cpu", dtype=torch.float16):
        out_policy = loaded.model(x)
    assert out_policy.dtype == torch.float32 and torch.allclose(out_policy, expected, atol=1e-6)
    assert ampaudit.autocast_policy(load_target(model("root_mask_fill.py")).model, out) == [""]


def test_the_autocast_policy_upcasts_tensors_inside_a_tuple_argument(tmp_path):
    # tuple_input_attention.py calls self.attn((q, k, v)): the emitted file cast only top-level
    # tensors, so the fp16 q, k, v reached the -1e9 fill and it raised as plain autocast does
    from ampaudit.cli.main import main

    out = tmp_path / "out"
    assert main(["convert", model("tuple_input_attention.py"), "-o", str(out), "--emit", "autocast",
                 "--train-steps", "0"]) == 0
    policy = _module(out / "autocast_policy.py", "autocast_policy_tuple")
    assert policy.FP32_MODULES == ["attn"]
    for apply in (policy.apply, lambda m: ampaudit.autocast_policy(m, out)):
        loaded = load_target(model("tuple_input_attention.py"))
        (x,) = loaded.inputs.args
        expected = loaded.model(x)
        apply(loaded.model)
        with torch.autocast("cpu", dtype=torch.float16):
            got = loaded.model(x)
        assert got.dtype == torch.float32  # attn's output Linear ran in fp32
        assert float((got - expected).norm() / expected.norm()) < 1e-2


def test_the_hf_names_keep_only_the_plans_modules_in_fp32_under_from_pretrained(tmp_path):
    # a plan that keeps GPT-2's block h.1 in fp32: its last name, "1", was the entry, and
    # transformers (regular expressions over weight names) then kept h.10 and every ln_1 too
    transformers = pytest.importorskip("transformers")
    from ampaudit.convert.emit import emit

    config = transformers.GPT2Config(n_layer=11, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    records = [{"module": "transformer.h.1", "compute": "float32", "rule": "verify"},
               {"module": "transformer.h.3.mlp", "compute": "float32", "rule": "AMP301"}]
    (tmp_path / "hf_keep_in_fp32.py").write_text(emit({"plan": records, "summary": {"dtype": "float16"}}, "hf"))
    names = _module(tmp_path / "hf_keep_in_fp32.py", "hf_keep_gpt2").KEEP_IN_FP32

    class Kept(transformers.GPT2LMHeadModel):
        _keep_in_fp32_modules = names

    loaded = Kept.from_pretrained(tmp_path / "gpt2", dtype=torch.float16)
    fp32 = {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}
    expected = {n for n, _ in loaded.named_parameters()
                if n.startswith(("transformer.h.1.", "transformer.h.3.mlp."))}
    assert fp32 == expected and len(expected) == 16


def test_a_forward_the_fx_backend_left_untraced_is_kept_in_fp32_by_the_policies(tmp_path):
    # --backend fx keeps BranchyAttention's own forward in fp32, untraced: its -1e9 fill is in
    # no plan record, so the policies listed nothing and autocast raised on it
    from ampaudit.cli.main import main

    out = tmp_path / "out"
    assert main(["convert", model("untraced_attention_fill.py"), "-o", str(out), "--backend", "fx", "--emit",
                 "autocast", "--emit", "hf", "--emit", "fsdp2", "--train-steps", "0"]) == 0
    policy = _module(out / "autocast_policy.py", "autocast_policy_untraced")
    assert policy.FP32_MODULES == ["attn"]
    assert "# 'attn': forward not traced (--backend fx)" in (out / "autocast_policy.py").read_text()
    assert _module(out / "hf_keep_in_fp32.py", "hf_keep_untraced").KEEP_IN_FP32 == ["attn"]
    # FSDP2: attn's own ops compute in fp32 (the root's unit), its Linears low in their own units
    assert _module(out / "fsdp2_policy.py", "fsdp2_untraced").LOW_MODULES == ["inp", "out", "attn.q", "attn.k"]
    loaded = load_target(model("untraced_attention_fill.py"))
    (x,) = loaded.inputs.args
    expected = loaded.model(x)
    policy.apply(loaded.model)
    with torch.autocast("cpu", dtype=torch.float16):
        got = loaded.model(x)
    assert float((got.float() - expected).norm() / expected.norm()) < 1e-2


def test_the_autocast_policy_keeps_an_accelerate_offload_hook_on_the_module(tmp_path):
    # accelerate's cpu_offload puts the weights on "meta" and gives each module with weights an
    # instance forward that loads them; the policy called the class's forward past it:
    # "Tensor on device meta is not on the expected device cpu!"
    accelerate = pytest.importorskip("accelerate")
    from ampaudit.convert.emit import emit

    records = [{"module": "attn.q", "compute": "float32", "rule": "declared"}]
    (tmp_path / "autocast_policy.py").write_text(emit({"plan": records, "summary": {"dtype": "float16"}}, "autocast"))
    policy = _module(tmp_path / "autocast_policy.py", "autocast_policy_offload")
    for apply in (policy.apply, lambda m: ampaudit.autocast_policy(m, {"plan": records})):
        loaded = load_target(model(FIXTURE))
        (x,) = loaded.inputs.args
        expected = loaded.model(x)
        accelerate.cpu_offload(loaded.model, execution_device=torch.device("cpu"))
        assert loaded.model.attn.q.weight.device.type == "meta"
        apply(loaded.model)
        apply(loaded.model)  # twice: wrapped once
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = loaded.model(x)
        assert float((got.float() - expected).norm() / expected.norm()) < 2e-2


def test_a_bfloat16_hf_policy_names_the_attribute_transformers_applies_under_bfloat16(tmp_path):
    # transformers applies _keep_in_fp32_modules under float16 only: the bf16 plan's names, set
    # there as the file said, left every weight in bf16; _keep_in_fp32_modules_strict applies
    transformers = pytest.importorskip("transformers")
    from ampaudit.convert.emit import emit

    config = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    records = [{"module": "transformer.h.1.mlp", "compute": "float32", "rule": "verify"}]
    (tmp_path / "hf_keep_in_fp32.py").write_text(emit({"plan": records, "summary": {"dtype": "bfloat16"}}, "hf"))
    hf = _module(tmp_path / "hf_keep_in_fp32.py", "hf_keep_bf16")
    assert f"MyModel.{hf.ATTRIBUTE} = KEEP_IN_FP32" in hf.__doc__

    class Kept(transformers.GPT2LMHeadModel):
        pass

    setattr(Kept, hf.ATTRIBUTE, hf.KEEP_IN_FP32)
    loaded = Kept.from_pretrained(tmp_path / "gpt2", dtype=torch.bfloat16)
    fp32 = {n for n, p in loaded.named_parameters() if p.dtype == torch.float32}
    assert fp32 == {n for n, _ in loaded.named_parameters() if n.startswith("transformer.h.1.mlp.")} and len(fp32) == 4


def test_hf_names_are_literal_regular_expressions():
    # transformers searches weight names with each entry as a regular expression: a ModuleDict
    # key `a+b` matched `aab` (and `h.1`'s dot any character) before the path was escaped
    import re

    from ampaudit.convert.emit import hf_name

    assert hf_name("experts.a+b") == r"experts\.a\+b"
    assert re.search(hf_name("experts.a+b"), "experts.a+b.weight")
    assert not re.search(hf_name("experts.a+b"), "experts.aab.weight")
    assert re.search(hf_name("h.1"), "transformer.h.1.attn.weight")
    assert not re.search(hf_name("h.1"), "transformer.h.10.attn.weight") and not re.search(hf_name("h.1"), "hx1.w")
