"""--emit policies trained for real: each emitted file (autocast, fsdp2) trains an
Annotated-Transformer-shaped model, GPT-2 and T5 beside torch.autocast + GradScaler, with the
dtype every catalog fp32 op ran in recorded at the aten level; the hf file says it is for
inference."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ampaudit.core.catalog import builtin_catalog
from ampaudit.core.findings import Precision
from ampaudit.load.loader import load_target
from tests.conftest import model

pytest.importorskip("transformers")

MODELS = ("emit_transformer.py", "hf_gpt2.py", "hf_t5.py")
LOW = torch.float16
TOLERANCE = 0.02  # relative loss gap to autocast's after training
# catalog fp32 ops each model runs: the recorder sees its loss (KLDivLoss is aten's sum of
# a product), norm and softmax
RUNS = {"emit_transformer.py": {"sum", "std", "mean", "softmax", "log_softmax", "embedding"},
        "hf_gpt2.py": {"nll_loss", "log_softmax", "layer_norm", "softmax", "pow", "embedding"},
        "hf_t5.py": {"nll_loss", "log_softmax", "rsqrt", "pow", "mean", "softmax", "embedding"}}
# FSDP2 warns that a unit returned a view; the policy's units cast their output to fp32
# after that check, a new tensor, so an in-place op on it cannot drop their backward hook
pytestmark = pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")

# Catalog fp32 ops that CUDA autocast upcasts (catalog autocast = "fp32") and CPU autocast
# leaves in the dtype of their inputs: on this CPU an autocast-based policy runs them low where
# their inputs are low; on CUDA autocast runs them in fp32 (test_cpu_autocast_leaves_them_low).
CPU_AUTOCAST_LEAVES = {
    "softmax": lambda x: x.softmax(-1),
    "log_softmax": lambda x: x.log_softmax(-1),
    "layer_norm": lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:]),
    "pow": lambda x: x.pow(2),
    "sum": lambda x: x.sum(),
    "rsqrt": lambda x: x.abs().rsqrt(),
}


class OpDtypes(TorchDispatchMode):
    """The floating input dtypes of every catalog fp32 op that ran, by kind (below autocast:
    what each kernel really computed in)."""

    def __init__(self) -> None:
        super().__init__()
        self.catalog = builtin_catalog()
        self.ran: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # aten's structured ops name their forward *_forward (nll_loss_forward)
        kind = self.catalog.canonical_kind(func._schema.name.removesuffix("_forward"))
        policy = self.catalog.lookup(kind)
        if policy is not None and policy.precision is Precision.FP32:
            dtypes = {t.dtype for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                      and t.is_floating_point()}
            self.ran.setdefault(kind, set()).update(dtypes)
        return func(*args, **(kwargs or {}))

    def low(self) -> set[str]:
        return {kind for kind, dtypes in self.ran.items() if LOW in dtypes}


def _module(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Exports(dict):
    """Each model's export folder, converted the first time a test asks (one model's tests
    run alone with -k convert only it)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, name):
        from ampaudit.cli.main import main

        out = self.tmp_path_factory.mktemp("emit") / "out"
        assert main(["convert", model(name), "-o", str(out), "--emit", "autocast", "--emit", "fsdp2", "--emit", "hf",
                     "--train-steps", "0", "--no-verify"]) == 0
        self[name] = out
        return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    return _Exports(tmp_path_factory)


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not built")
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{store}")
    yield
    dist.destroy_process_group()


def _build(name):
    torch.manual_seed(0)
    loaded = load_target(model(name))
    # eval: no dropout, so two runs differ only by their precision
    return loaded.model.eval(), loaded.inputs.args, loaded.inputs.kwargs


def _loss(out):
    return out if isinstance(out, torch.Tensor) else out.loss


def train(net, args, kwargs, steps, *, autocast):
    """``steps`` AdamW steps with a GradScaler, the op dtypes of the first and last forward
    recorded; returns (losses, OpDtypes)."""
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    seen, losses = OpDtypes(), []
    for step in range(steps):
        with seen if step in (0, steps - 1) else contextlib.nullcontext(), \
                torch.autocast("cpu", dtype=LOW, enabled=autocast):
            loss = _loss(net(*args, **kwargs))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]  # it learned
    return losses, seen


def autocast_reference(name, steps):
    """torch.autocast + GradScaler: plain where it runs; the Annotated Transformer's -1e9
    fill of fp16 scores raises under plain autocast, so there with the autocast policy."""
    net, args, kwargs = _build(name)
    try:
        return train(net, args, kwargs, steps, autocast=True)
    except RuntimeError as exc:
        assert name == "emit_transformer.py" and "c10::Half without overflow" in str(exc)
    return None


def _fsdp2(exports, name, steps):
    policy = _module(exports[name] / "fsdp2_policy.py", f"fsdp2_{name[:-3]}")
    net, args, kwargs = _build(name)
    policy.shard(net)
    return train(net, args, kwargs, steps, autocast=False)


def _autocast_policy(exports, name, steps):
    policy = _module(exports[name] / "autocast_policy.py", f"autocast_{name[:-3]}")
    net, args, kwargs = _build(name)
    policy.apply(net)
    return (*train(net, args, kwargs, steps, autocast=True), policy.FP32_MODULES)


def _measured_low(export) -> set[str]:
    plan = json.loads((export / "plan.json").read_text())["plan"]
    return {r["kind"] for r in plan if r["rule"] == "measured"}


def _close(losses, reference):
    gap = abs(losses[-1] - reference[-1]) / abs(reference[-1])
    assert gap < TOLERANCE, (losses[-1], reference[-1])


@pytest.mark.parametrize("name", MODELS)
def test_fsdp2_policy_trains_with_every_catalog_fp32_op_in_fp32(exports, process_group, name):
    # FSDP2 upcasts no op: the policy keeps each module holding one (norms, softmax, the
    # loss) out of the fp16 units, and casts the units' inputs (the Transformer's fp32 `pe`
    # makes fp32 activations) - before, the Transformer raised "mat1 and mat2 must have the
    # same dtype" and GPT-2 and T5 ran layer_norm, log_softmax and nll_loss in fp16
    losses, seen = _fsdp2(exports, name, 3)
    # except a catalog fp32 op the plan keeps low by its measured range (GPT-2's tanh GELU's
    # pow(x, 3): rule "measured")
    assert seen.low() <= _measured_low(exports[name]), seen.ran
    assert RUNS[name] <= set(seen.ran)
    reference = autocast_reference(name, 3) or _autocast_policy(exports, name, 3)[:2]
    assert abs(losses[0] - reference[0][0]) / reference[0][0] < 1e-2


@pytest.mark.parametrize("name", MODELS)
def test_autocast_policy_trains_with_catalog_fp32_ops_upcast(exports, name):
    losses, seen, overridden = _autocast_policy(exports, name, 3)
    assert RUNS[name] <= set(seen.ran)
    # only what CPU autocast leaves low (CUDA's upcasts it) may run in fp16 here
    assert seen.low() <= set(CPU_AUTOCAST_LEAVES), seen.ran
    reference = autocast_reference(name, 3)
    if name == "emit_transformer.py":
        # the -1e9 fill: plain autocast raises; the policy runs the attention, softmax and
        # all, in fp32
        assert reference is None and seen.ran["softmax"] == {torch.float32}
    elif overridden:  # T5's wo, declared fp32 by the model
        assert abs(losses[0] - reference[0][0]) / reference[0][0] < 1e-3
    else:  # nothing overridden: the policy changes nothing
        assert losses == reference[0]


@pytest.mark.slow  # 100 steps of each policy and of autocast, three models
@pytest.mark.parametrize("name", MODELS)
def test_policies_train_100_steps_as_autocast_does(exports, process_group, name):
    reference = autocast_reference(name, 100)
    autocast_losses, autocast_seen, _ = _autocast_policy(exports, name, 100)
    fsdp2_losses, fsdp2_seen = _fsdp2(exports, name, 100)
    reference = reference[0] if reference else autocast_losses
    _close(autocast_losses, reference)
    _close(fsdp2_losses, reference)
    # the dtype each catalog fp32 op ran in, at the first step and the 100th
    assert RUNS[name] <= set(fsdp2_seen.ran) and fsdp2_seen.low() <= _measured_low(exports[name]), fsdp2_seen.ran
    assert RUNS[name] <= set(autocast_seen.ran) and autocast_seen.low() <= set(CPU_AUTOCAST_LEAVES), autocast_seen.ran


def test_cpu_autocast_leaves_them_low():
    # the CPU/CUDA difference the autocast checks allow for, shown rather than assumed
    catalog = builtin_catalog()
    x = torch.rand(4, 8, dtype=LOW) + 0.5
    for kind, op in CPU_AUTOCAST_LEAVES.items():
        assert catalog.lookup(kind).autocast == "fp32", kind  # CUDA autocast upcasts it
        with OpDtypes() as seen, torch.autocast("cpu", dtype=LOW):
            op(x)
        assert seen.ran[kind] == {LOW}, kind


def test_hf_policy_says_it_is_for_inference(exports):
    text = (exports["emit_transformer.py"] / "hf_keep_in_fp32.py").read_text()
    assert "For inference, not for training" in text
    assert "GradScaler" in text and "ampaudit.convert" in text
    # what it warns about: fp16 weights' gradients are fp16, and GradScaler refuses them
    linear = torch.nn.Linear(4, 4).to(LOW)
    opt = torch.optim.AdamW(linear.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(linear(torch.ones(2, 4, dtype=LOW)).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)
        self.register_buffer("shift", torch.ones(8))  # fp32, whatever the parameters' dtype

    def forward(self, x):
        return self.b(self.a(x) + self.shift)


class _TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.block = _Block()
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.block(self.emb(ids))).log_softmax(-1)


def test_fsdp2_policy_skips_tied_and_buffered_modules(tmp_path, process_group):
    # block's ops all compute in fp16, but as one unit its fp32 buffer would make b's input
    # fp32 (no boundary casts it): its children are the units; head's weight is emb's, and
    # FSDP2 refuses a tied parameter in two units: it computes in fp32 with the root
    import ampaudit
    from ampaudit.convert.emit import emit

    ids = torch.randint(0, 10, (2, 4))
    torch.manual_seed(0)
    net = _TiedNet()
    (tmp_path / "tied_policy.py").write_text(emit(ampaudit.convert(net, (ids,), verify=False), "fsdp2"))
    policy = _module(tmp_path / "tied_policy.py", "tied_policy")
    assert policy.LOW_MODULES == ["block", "block.a", "block.b", "head"]
    assert policy.shard(net) == ["block.a", "block.b"]
    with OpDtypes() as seen:
        out = net(ids)
    out.sum().backward()  # (backward's bias gradients sum in fp16: not forward ops)
    assert seen.low() == set() and {"embedding", "log_softmax"} <= set(seen.ran)
