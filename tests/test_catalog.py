"""The op-precision catalog (rules/ops.toml) and its lookups."""

from __future__ import annotations

import ast
import inspect
import operator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampaudit.core.catalog import AUTOCAST_BEHAVIOURS, Catalog, builtin_catalog, load_catalog
from ampaudit.core.errors import UsageError
from ampaudit.core.findings import Precision
from ampaudit.core.resources import load_toml, rules_dir

CATALOG = builtin_catalog()


# -- the shipped file -------------------------------------------------------------------


def test_builtin_catalog_is_large_and_consistent() -> None:
    assert len(CATALOG.ops) >= 250
    assert set(CATALOG.aliases).isdisjoint(CATALOG.ops), "an alias shadows an op of the same name"
    dangling = {k: v for k, v in {**CATALOG.aliases, **CATALOG.modules}.items() if v not in CATALOG.ops}
    assert not dangling


def test_ops_toml_keeps_its_schema_header() -> None:
    text = (rules_dir() / "ops.toml").read_text(encoding="utf-8")
    assert text.startswith("# ampaudit op-precision catalog.")
    for field in ("precision", "reason", "source", "autocast", "fp32_under_autocast"):
        assert f"#   {field}" in text
    assert load_toml(rules_dir() / "ops.toml")["schema"] == 1


@pytest.mark.parametrize("kind", sorted(CATALOG.ops))
def test_every_entry_explains_itself(kind: str) -> None:
    policy = CATALOG.ops[kind]
    assert policy.kind == kind
    assert policy.reason.strip() and "\n" not in policy.reason
    assert policy.source.strip()
    assert policy.autocast in AUTOCAST_BEHAVIOURS
    assert isinstance(policy.precision, Precision)
    if policy.fp32_under_autocast:
        assert policy.precision is Precision.FP32


def test_autocast_banned_op_points_at_the_safe_alternative() -> None:
    bce = CATALOG.lookup("binary_cross_entropy")
    assert bce is not None
    assert (bce.precision, bce.autocast) == (Precision.FP32, "banned")
    assert "BCEWithLogits" in bce.reason


@pytest.mark.parametrize(
    ("kind", "precision", "autocast", "fp32_under_autocast"),
    [
        ("linear", "fp16", "fp16", False),
        ("conv_transpose2d", "fp16", "fp16", False),
        ("scaled_dot_product_attention", "fp16", "fp16", False),
        ("softmax", "fp32", "fp32", False),
        ("layer_norm", "fp32", "fp32", False),
        ("cross_entropy", "fp32", "fp32", False),
        ("upsample_bilinear2d", "fp32", "fp32", False),
        ("batch_norm", "fp32", "none", True),
        ("embedding", "fp32", "none", True),
        ("mean", "fp32", "none", False),
        ("var", "fp32", "none", False),
        ("normalize", "fp32", "fp32", False),
        ("sqrt", "neutral", "none", False),
        ("gelu", "neutral", "none", False),
        ("dropout", "neutral", "none", False),
        ("max_pool2d", "neutral", "none", False),
        ("view", "neutral", "none", False),
        ("getitem", "neutral", "none", False),
        ("to", "neutral", "none", False),
        ("add", "promote", "none", False),
        ("cat", "promote", "none", False),
        ("eq", "promote", "none", False),
        ("addcmul", "promote", "promote", False),
        ("binary_cross_entropy", "fp32", "banned", False),
    ],
)
def test_representative_policies(kind: str, precision: str, autocast: str, fp32_under_autocast: bool) -> None:
    policy = CATALOG.lookup(kind)
    assert policy is not None
    assert (policy.precision.value, policy.autocast, policy.fp32_under_autocast) == (
        precision,
        autocast,
        fp32_under_autocast,
    )


# -- modules ------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(CATALOG.modules))
def test_module_keys_name_real_torch_nn_classes(key: str) -> None:
    prefix, _, name = key.rpartition(".")
    assert prefix == "torch.nn"
    cls = getattr(nn, name, None)
    assert inspect.isclass(cls) and issubclass(cls, nn.Module), f"{key} is not a torch.nn module class"
    assert CATALOG.kind_of_module_type(cls) == CATALOG.modules[key]


def test_every_layer_class_of_torch_nn_is_mapped() -> None:
    containers = {"Module", "Container", "Sequential", "ModuleList", "ModuleDict", "ParameterList",
                  "ParameterDict", "DataParallel", "RNNBase", "RNNCellBase"}  # fmt: skip
    layers = {
        name
        for name, cls in vars(nn).items()
        if inspect.isclass(cls) and issubclass(cls, nn.Module) and name not in containers
    }
    assert sorted(name for name in layers if f"torch.nn.{name}" not in CATALOG.modules) == []


@pytest.mark.parametrize(
    ("cls", "kind"),
    [
        (nn.LayerNorm, "layer_norm"),
        (nn.BatchNorm2d, "batch_norm"),
        (nn.SyncBatchNorm, "batch_norm"),
        (nn.Linear, "linear"),
        (nn.LazyLinear, "linear"),
        (nn.Conv2d, "conv2d"),
        (nn.MultiheadAttention, "multihead_attention"),
        (nn.TransformerEncoderLayer, "transformer_encoder_layer"),
        (nn.LSTM, "lstm"),
        (nn.Softmax, "softmax"),
        (nn.Embedding, "embedding"),
        (nn.BCELoss, "binary_cross_entropy"),
        (nn.CrossEntropyLoss, "cross_entropy"),
        (nn.Upsample, "interpolate"),
        (nn.ReflectionPad2d, "pad"),
    ],
)
def test_module_types_map_to_kinds(cls: type, kind: str) -> None:
    assert CATALOG.kind_of_module_type(cls) == kind


def test_user_subclass_maps_through_the_mro() -> None:
    class MyLinear(nn.Linear):
        pass

    class MyNorm(nn.LayerNorm):
        pass

    assert CATALOG.kind_of_module_type(MyLinear) == "linear"
    assert CATALOG.kind_of_module_type(MyNorm) == "layer_norm"
    assert CATALOG.kind_of_module_type(nn.Sequential) is None


def test_multihead_attention_is_fp16_with_an_upcast_softmax() -> None:
    policy = CATALOG.lookup("multihead_attention")
    assert policy is not None
    assert (policy.precision, policy.autocast) == (Precision.LOW, "fp16")
    assert "softmax" in policy.reason


# -- names --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("__radd__", "add"),
        ("__iadd__", "add"),
        ("__matmul__", "matmul"),
        ("__rmatmul__", "matmul"),
        ("__pow__", "pow"),
        ("__truediv__", "div"),
        ("__floordiv__", "floor_divide"),
        ("__getitem__", "getitem"),
        ("add_", "add"),
        ("masked_fill_", "masked_fill"),
        ("relu_", "relu"),
        ("softmax", "softmax"),
        ("aten::_softmax.default", "softmax"),
        ("aten::_log_softmax", "log_softmax"),
        ("aten::native_layer_norm.default", "layer_norm"),
        ("aten::_native_batch_norm_legit_no_training.default", "batch_norm"),
        ("aten::_scaled_dot_product_flash_attention.default", "scaled_dot_product_attention"),
        ("aten::_scaled_dot_product_efficient_attention.default", "scaled_dot_product_attention"),
        ("aten::cross_entropy_loss", "cross_entropy"),
        ("aten::_convolution.deprecated", "convolution"),
        ("aten::addmm.default", "addmm"),
        ("aten::_to_copy.default", "to"),
        ("linalg_vecdot", "vecdot"),
        ("truediv", "div"),
        ("floordiv", "floor_divide"),
        ("an_op_nobody_knows", "an_op_nobody_knows"),
    ],
)
def test_canonical_kind(name: str, kind: str) -> None:
    assert CATALOG.canonical_kind(name) == kind


@pytest.mark.parametrize(
    ("fn", "kind"),
    [
        (torch.ops.aten.native_layer_norm.default, "layer_norm"),
        (torch.ops.aten._softmax.default, "softmax"),
        (torch.ops.aten.mm.default, "mm"),
        (operator.truediv, "div"),
        (operator.add, "add"),
        (operator.iadd, "add"),
        (operator.matmul, "matmul"),
        (operator.getitem, "getitem"),
        (getattr, "getattr"),
        (torch.relu, "relu"),
        (torch.Tensor.add_, "add"),
        (torch.Tensor.__rsub__, "sub"),
        (F.linear, "linear"),
        (F.logsigmoid, "logsigmoid"),  # __name__ is log_sigmoid
        (F.threshold, "threshold"),  # __name__ is _threshold
        (F.max_pool2d, "max_pool2d"),
        (F.interpolate, "interpolate"),
        (F.scaled_dot_product_attention, "scaled_dot_product_attention"),
        (F.multi_head_attention_forward, "multihead_attention"),
        (torch.linalg.vecdot, "vecdot"),
        (torch.linalg.vector_norm, "vector_norm"),
        (torch.linalg.matmul, "matmul"),
    ],
)
def test_kind_of_callable(fn: object, kind: str) -> None:
    assert CATALOG.kind_of_callable(fn) == kind
    assert kind in CATALOG.ops


# -- user overlays --------------------------------------------------------------------------


def test_search_matches_kinds_aliases_and_module_types_in_any_case() -> None:
    by_kind = {m.kind: m for m in CATALOG.search("SOFTMAX")}
    assert "softmax" in by_kind and "log_softmax" in by_kind
    assert "torch.nn.Softmax" in by_kind["softmax"].also  # the names that also map to the kind, sorted
    assert list(by_kind["softmax"].also) == sorted(by_kind["softmax"].also)
    assert by_kind["softmax"].policy == CATALOG.lookup("softmax")
    alias, kind = next(iter(sorted(CATALOG.aliases.items())))
    assert kind in {m.kind for m in CATALOG.search(alias.upper())}
    everything = CATALOG.search("")
    assert [m.kind for m in everything] == sorted(CATALOG.ops)
    assert CATALOG.search("no_such_op_anywhere") == []


def test_override_keeps_the_autocast_fact() -> None:
    merged = CATALOG.merged({"ops": {"layer_norm": {"precision": "fp16", "reason": "we measured it"}}}, "t.toml")
    policy = merged.lookup("layer_norm")
    assert policy is not None
    assert policy.precision is Precision.LOW
    assert policy.reason == "we measured it"
    assert policy.autocast == "fp32"  # what autocast does did not change
    assert policy.source == "user policy (t.toml)"
    assert CATALOG.lookup("layer_norm").precision is Precision.FP32  # the builtin is untouched


def test_override_with_a_bare_precision_string() -> None:
    merged = CATALOG.merged({"ops": {"gelu": "fp32"}}, "t.toml")
    policy = merged.lookup("gelu")
    assert policy is not None and policy.precision is Precision.FP32


def test_overlay_adds_an_op_an_alias_and_a_module() -> None:
    overlay = {
        "ops": {"my_fused_norm": {"precision": "fp32", "reason": "fused RMS norm"}},
        "aliases": {"my_fused_norm_impl": "my_fused_norm"},
        "modules": {"mypkg.layers.FusedNorm": "my_fused_norm"},
    }
    merged = CATALOG.merged(overlay, "pyproject.toml")
    policy = merged.lookup("my_fused_norm")
    assert policy is not None
    assert (policy.precision, policy.autocast, policy.reason) == (Precision.FP32, "none", "fused RMS norm")
    assert merged.canonical_kind("aten::my_fused_norm_impl.default") == "my_fused_norm"
    assert "mypkg.layers.FusedNorm" in merged.modules
    assert len(merged.ops) == len(CATALOG.ops) + 1


class FusedNorm(nn.Module):
    """A user's own layer, mapped to a kind by a policy overlay."""


class SubNorm(FusedNorm):
    pass


def test_overlay_maps_a_user_module_class_by_name() -> None:
    assert CATALOG.kind_of_module_type(FusedNorm) is None
    by_name = CATALOG.merged({"modules": {"FusedNorm": "layer_norm"}}, "t.toml")
    assert by_name.kind_of_module_type(FusedNorm) == "layer_norm"
    assert by_name.kind_of_module_type(SubNorm) == "layer_norm"
    dotted = f"{FusedNorm.__module__}.FusedNorm"
    by_path = CATALOG.merged({"modules": {dotted: "rms_norm"}}, "t.toml")
    assert by_path.kind_of_module_type(SubNorm) == "rms_norm"


def test_overlay_group_applies_to_many_ops() -> None:
    merged = CATALOG.merged({"group": [{"precision": "fp32", "ops": ["gelu", "silu"]}]}, "t.toml")
    assert merged.lookup("gelu").precision is Precision.FP32
    assert merged.lookup("silu").precision is Precision.FP32


def test_invalid_precision_is_a_usage_error_naming_the_key() -> None:
    with pytest.raises(UsageError, match=r"ops\.softmax\.precision") as info:
        CATALOG.merged({"ops": {"softmax": {"precision": "fp8"}}}, "bad.toml")
    assert "bad.toml" in str(info.value)
    assert "'fp8'" in str(info.value)


@pytest.mark.parametrize(
    ("overlay", "message"),
    [
        ({"ops": {"softmax": {"precision": "fp32", "autocast": "maybe"}}}, r"ops\.softmax\.autocast"),
        ({"ops": {"softmax": {"precision": "fp32", "colour": "red"}}}, r"unknown key\(s\) colour"),
        ({"ops": {"softmax": 3}}, r"ops\.softmax must be a table"),
        ({"ops": {"not-an-op": "fp32"}}, r"is not an op name"),
        ({"group": [{"precision": "fp32"}]}, r"group #1 needs a non-empty ops list"),
        ({"group": [{"precision": "fp32", "ops": [1, 2]}]}, r"group #1 needs a non-empty ops list of op names"),
        ({"rules": {}}, r"unknown section\(s\) rules"),
    ],
)
def test_malformed_overlays_are_usage_errors(overlay: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        CATALOG.merged(overlay, "bad.toml")


def test_load_catalog_layers_tables_then_policy_files(tmp_path: Path) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text('[ops.gelu]\nprecision = "fp32"\nreason = "file wins"\n', encoding="utf-8")
    table = {"ops": {"gelu": {"precision": "fp16", "reason": "table"}, "silu": "fp32"}}
    catalog = load_catalog(policy_files=[policy], tables=[(table, "pyproject.toml")])
    assert isinstance(catalog, Catalog)
    assert catalog.lookup("gelu").reason == "file wins"
    assert catalog.lookup("silu").precision is Precision.FP32
    assert load_catalog() is builtin_catalog()


def test_load_catalog_missing_policy_file_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(UsageError, match="policy file not found"):
        load_catalog(policy_files=[missing])


def test_load_catalog_unreadable_policy_file_is_a_usage_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken.toml"
    broken.write_text("[ops.gelu\n", encoding="utf-8")
    with pytest.raises(UsageError, match="cannot read policy file"):
        load_catalog(policy_files=[broken])


# -- op traits ------------------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parent.parent / "ampaudit"
# Where graph passes decide what to do by an op's kind: the traits they use live in ops.toml.
TRAIT_READERS = (PACKAGE / "graph", PACKAGE / "check" / "graph_rules")


def _traits_read() -> dict[str, list[str]]:
    """Trait name -> the files that read it with ``catalog.trait("name", ...)``."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "trait":
                for a in node.args:
                    assert isinstance(a, ast.Constant) and isinstance(a.value, str), f"{path}: trait names are literals"
                    found.setdefault(a.value, []).append(path.name)
    return found


def test_ops_toml_documents_the_traits_schema() -> None:
    text = (rules_dir() / "ops.toml").read_text(encoding="utf-8")
    header = text.split("schema = 1", 1)[0]
    assert "[traits.NAME]" in header
    for field in ("description", "ops"):
        assert f"#   {field}" in header


@pytest.mark.parametrize("name", sorted(CATALOG.traits))
def test_every_trait_names_known_op_kinds_and_explains_itself(name: str) -> None:
    trait = CATALOG.traits[name]
    assert trait.name == name
    assert trait.description.strip() and "\n" not in trait.description
    assert trait.ops
    # Kinds of the catalog, not aliases: a node's kind is never an alias, so an alias would match nothing.
    assert sorted(trait.ops - set(CATALOG.ops)) == []
    assert CATALOG.trait(name) == trait.ops


def test_every_trait_is_read_and_every_read_trait_exists() -> None:
    read = _traits_read()
    assert sorted(set(read) - set(CATALOG.traits)) == [], "a pass reads a trait ops.toml lacks"
    assert sorted(set(CATALOG.traits) - set(read)) == [], "a trait no pass reads"


def _op_kind_sets(source: str, kinds: set[str]) -> list[int]:
    """Lines of the set and frozenset literals whose elements are all strings naming op kinds."""
    found = []
    for node in ast.walk(ast.parse(source)):
        elements = None
        if isinstance(node, ast.Set):
            elements = node.elts
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset")
              and len(node.args) == 1 and isinstance(node.args[0], (ast.Set, ast.List, ast.Tuple))):
            elements = node.args[0].elts
        if elements and all(isinstance(e, ast.Constant) and e.value in kinds for e in elements):
            found.append(node.lineno)
    return sorted(set(found))


OP_NAMES = set(CATALOG.ops) | set(CATALOG.aliases)


def test_no_set_of_op_kinds_is_left_in_graph_code() -> None:
    """A set of op kinds in a pass is an op trait: it belongs in ops.toml's [traits]."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for folder in TRAIT_READERS for path in sorted(folder.rglob("*.py"))
             for line in _op_kind_sets(path.read_text(encoding="utf-8"), OP_NAMES)]
    assert found == []


def test_the_op_kind_set_scan_finds_what_it_looks_for() -> None:
    source = ('_A = frozenset({"relu", "abs"})\n_B = {"swapaxes"}\n_C = {"shape", "relu"}\n_D = set(["exp"])\n'
              '_E = ("relu", "abs")\n_F = frozenset()\n')
    assert _op_kind_sets(source, OP_NAMES) == [1, 2, 4]


def test_trait_reads_are_unions_resolved_once() -> None:
    both = CATALOG.trait("same_values", "passes_values")
    assert both == CATALOG.trait("same_values") | CATALOG.trait("passes_values")
    assert CATALOG.trait("same_values", "passes_values") is both
    with pytest.raises(KeyError, match="no op trait 'moves_values'"):
        CATALOG.trait("moves_values")


def test_overlay_adds_ops_to_a_trait() -> None:
    overlay = {
        "ops": {"my_shuffle": {"precision": "neutral", "reason": "permutes channels"}},
        "traits": {"same_values": {"ops": ["my_shuffle"]}, "non_negative": {"description": "mine", "ops": ["gelu"]}},
    }
    merged = CATALOG.merged(overlay, "t.toml")
    assert merged.trait("same_values") == CATALOG.trait("same_values") | {"my_shuffle"}
    assert merged.trait("non_negative") == CATALOG.trait("non_negative") | {"gelu"}
    assert merged.traits["non_negative"].description == CATALOG.traits["non_negative"].description
    assert "my_shuffle" not in CATALOG.trait("same_values")  # the builtin is untouched
    assert merged.merged({"ops": {"gelu": "fp32"}}, "u.toml").trait("non_negative") == merged.trait("non_negative")


@pytest.mark.parametrize(
    ("traits", "message"),
    [
        ({"moves_values": {"ops": ["view"]}}, r"traits\.moves_values is not a trait ampaudit reads \(it reads "),
        ({"same_values": {"ops": ["swapaxes"]}}, r"'swapaxes', .* \(it is an alias of 'transpose'"),
        ({"same_values": {"ops": ["veiw"]}}, r"lists 'veiw', which is not an op kind \(did you mean 'view'\?\)"),
        ({"same_values": {"ops": []}}, r"traits\.same_values needs a non-empty ops list"),
        ({"same_values": {"ops": "view"}}, r"traits\.same_values needs a non-empty ops list"),
        ({"same_values": {"ops": ["view"], "why": "x"}}, r"traits\.same_values: unknown key\(s\) why"),
        ({"same_values": ["view"]}, r"traits\.same_values must be a table"),
        ({"same_values": {"ops": ["view"], "description": 3}}, r"traits\.same_values\.description must be a string"),
    ],
)
def test_malformed_trait_overlays_are_usage_errors(traits: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        CATALOG.merged({"traits": traits}, "bad.toml")
