"""The op-precision catalog: policy as data (rules/ops.toml), read by check and convert.

Every op the tools see - an fx ``call_function`` target, a tensor method, an aten
overload, an ``nn.Module`` leaf - is reduced to one canonical *kind* (``linear``,
``layer_norm``, ``softmax``...) by :func:`canonical_kind`, and the catalog maps kinds
to a :class:`OpPolicy`. Op *traits* (``[traits]``: "moves values unchanged", "never
negative"...) name the kinds a graph pass treats alike, read with :meth:`Catalog.trait`.
Users extend or override it with a TOML file of the same shape (``--policy FILE``) or
``[tool.ampaudit.policy]`` in pyproject.toml.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ampaudit.core.errors import UsageError
from ampaudit.core.findings import Precision
from ampaudit.core.outputs import refuse_special_file
from ampaudit.core.resources import load_toml, rules_dir

if TYPE_CHECKING:
    from ampaudit.core.config import Config

AUTOCAST_BEHAVIOURS = ("fp16", "fp32", "promote", "banned", "none")


@dataclass(frozen=True)
class OpPolicy:
    kind: str
    precision: Precision
    reason: str
    source: str
    # What CUDA autocast does with the op: runs it in fp16 ("fp16"), upcasts it ("fp32"),
    # promotes to the widest input ("promote"), refuses it ("banned"), or leaves it ("none").
    autocast: str = "none"
    # True when the op already computes in fp32 under autocast without being upcast
    # (fp32 weights, fp32 statistics inside the kernel), so nothing is left to do.
    fp32_under_autocast: bool = False
    # An fp32 op whose only hazard is range (pow): it computes in the low dtype when its output,
    # measured on the example inputs, stays this many times below the dtype's max.
    low_within: float | None = None


@dataclass(frozen=True)
class OpMatch:
    """A kind :meth:`Catalog.search` found: its policy and the other names that map to it."""

    policy: OpPolicy
    also: tuple[str, ...]  # its aliases and module types, sorted

    @property
    def kind(self) -> str:
        return self.policy.kind


@dataclass(frozen=True)
class Trait:
    """A property of ops that graph passes rely on, and the kinds that have it."""

    name: str
    description: str
    ops: frozenset[str]


def _dunder_core(name: str) -> str:
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        core = name[2:-2]
        # Reflected and in-place operator variants: __radd__ / __iadd__ -> add.
        if core[:1] in ("r", "i") and core[1:] in _BINARY_DUNDERS:
            core = core[1:]
        return core
    return name


_BINARY_DUNDERS = frozenset(
    ["add", "sub", "mul", "truediv", "floordiv", "div", "mod", "pow", "matmul", "and", "or", "xor", "lshift", "rshift"]
)


class Catalog:
    """Op kinds -> policy, plus the name aliases and module-type mapping that find the kind."""

    def __init__(
        self,
        ops: Mapping[str, OpPolicy],
        aliases: Mapping[str, str],
        modules: Mapping[str, str],
        declared: OpPolicy | None = None,
        traits: Mapping[str, Trait] | None = None,
    ) -> None:
        self.ops = dict(ops)
        self.aliases = dict(aliases)
        self.modules = dict(modules)
        # How ops in a module the model itself keeps in fp32 are classified ([declared]).
        self.declared = declared
        self.traits = dict(traits or {})
        self._trait_kinds: dict[tuple[str, ...], frozenset[str]] = {}

    # -- names -------------------------------------------------------------------------
    def canonical_kind(self, name: str) -> str:
        """Reduce a function, method or aten op name to its catalog kind.

        ``__radd__`` -> add, ``add_`` -> add, ``aten::_softmax.default`` -> softmax,
        ``truediv`` -> div (alias table).
        """
        if "::" in name:  # aten::name or aten::name.overload
            name = name.split("::", 1)[1].split(".", 1)[0]
        name = _dunder_core(name)
        if name in self.ops:
            return name
        if name in self.aliases:
            return self.aliases[name]
        if name.endswith("_") and not name.startswith("_"):  # in-place variant: add_ -> add
            name = name[:-1]
        return self.aliases.get(name, name)

    def kind_of_callable(self, fn: Any) -> str:
        """Kind of an fx ``call_function`` target (torch.relu, F.linear, operator.add...)."""
        overload = getattr(fn, "_schema", None)
        if overload is not None:  # an aten OpOverload
            return self.canonical_kind(str(overload.name))
        return self.canonical_kind(getattr(fn, "__name__", None) or type(fn).__name__)

    def kind_of_module_type(self, cls: type) -> str | None:
        """Kind of an nn.Module leaf, following the MRO so subclasses of nn.Linear still map."""
        for klass in cls.__mro__:
            for key in _module_keys(klass):
                if key in self.modules:
                    return self.modules[key]
        return None

    # -- policy ------------------------------------------------------------------------
    def lookup(self, kind: str) -> OpPolicy | None:
        return self.ops.get(kind)

    def search(self, pattern: str) -> list[OpMatch]:
        """The kinds whose name, alias or module type contains ``pattern`` (in any case), sorted
        by kind: ``ampaudit ops PATTERN``. An empty pattern matches every kind."""
        needle = pattern.lower()
        names: dict[str, list[str]] = {kind: [] for kind in self.ops}
        for name, kind in (*self.aliases.items(), *self.modules.items()):
            if kind in names:
                names[kind].append(name)
        return [OpMatch(self.ops[kind], tuple(sorted(also))) for kind, also in sorted(names.items())
                if needle in kind.lower() or any(needle in name.lower() for name in also)]

    # -- traits ------------------------------------------------------------------------
    def trait(self, *names: str) -> frozenset[str]:
        """The op kinds with any of the named traits: ``trait("non_negative")``,
        ``trait("same_values", "passes_values")``. Cached: passes call it per graph."""
        kinds = self._trait_kinds.get(names)
        if kinds is None:
            missing = [name for name in names if name not in self.traits]
            if missing:
                raise KeyError(f"no op trait {', '.join(map(repr, missing))} in the catalog")
            kinds = self._trait_kinds[names] = frozenset().union(*(self.traits[name].ops for name in names))
        return kinds

    def merged(self, overlay: Mapping[str, Any], origin: str) -> Catalog:
        """A new catalog with a user policy table (same schema as ops.toml) applied on top."""
        ops, aliases, modules, declared, traits = _parse(overlay, origin,
                                                         defaults={"source": f"user policy ({origin})"})
        merged_ops = dict(self.ops)
        for kind, entry in ops.items():
            base = merged_ops.get(kind)
            merged_ops[kind] = entry if base is None else replace(entry, autocast=_keep(entry, base))
        _unknown_kinds({**aliases, **modules}, merged_ops, origin)
        merged_aliases = {**self.aliases, **aliases}
        merged_traits = dict(self.traits)
        for name, (_, kinds) in traits.items():
            base = merged_traits.get(name)
            if base is None:
                raise UsageError(f"{origin}: traits.{name} is not a trait ampaudit reads "
                                 f"(it reads {', '.join(sorted(merged_traits))})")
            _check_trait_ops(name, kinds, merged_ops, merged_aliases, origin, UsageError)
            merged_traits[name] = replace(base, ops=base.ops | frozenset(kinds))
        return Catalog(merged_ops, merged_aliases, {**self.modules, **modules},
                       declared or self.declared, merged_traits)


def _keep(entry: OpPolicy, base: OpPolicy) -> str:
    # A user override changes our advice, not the fact of what autocast does.
    return base.autocast if entry.autocast == "none" else entry.autocast


def _module_keys(klass: type) -> Iterable[str]:
    module = klass.__module__ or ""
    qualname = klass.__qualname__
    yield f"{module}.{qualname}"
    if module.startswith("torch.nn.modules"):
        yield f"torch.nn.{qualname}"
    yield qualname


_KIND_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _entry(kind: str, raw: Any, origin: str, defaults: Mapping[str, Any]) -> OpPolicy:
    where = f"{origin}: ops.{kind}"
    if isinstance(raw, str):
        raw = {"precision": raw}
    if not isinstance(raw, Mapping):
        raise UsageError(f"{where} must be a table or a precision string")
    data = {**defaults, **raw}
    unknown = set(data) - {"precision", "reason", "source", "autocast", "fp32_under_autocast", "low_within", "ops"}
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    try:
        precision = Precision(data.get("precision"))
    except ValueError:
        raise UsageError(
            f"{where}.precision must be one of fp16, fp32, promote, neutral (got {data.get('precision')!r})"
        ) from None
    autocast = data.get("autocast", "none")
    if autocast not in AUTOCAST_BEHAVIOURS:
        raise UsageError(f"{where}.autocast must be one of {', '.join(AUTOCAST_BEHAVIOURS)}")
    low_within = data.get("low_within")
    if low_within is not None and (isinstance(low_within, bool) or not isinstance(low_within, (int, float))
                                   or not low_within >= 1):
        raise UsageError(f"{where}.low_within must be a number >= 1 (a factor below the low dtype's max)")
    if not _KIND_RE.match(kind):
        raise UsageError(f"{where}: {kind!r} is not an op name")
    return OpPolicy(
        kind=kind,
        precision=precision,
        reason=str(data.get("reason") or f"{precision.value} by {origin}"),
        source=str(data.get("source", origin)),
        autocast=autocast,
        fp32_under_autocast=bool(data.get("fp32_under_autocast", False)),
        low_within=None if low_within is None else float(low_within),
    )


def _parse(
    table: Mapping[str, Any], origin: str, defaults: Mapping[str, Any] | None = None
) -> tuple[dict[str, OpPolicy], dict[str, str], dict[str, str], OpPolicy | None,
           dict[str, tuple[str | None, list[str]]]]:
    defaults = dict(defaults or {})
    unknown = set(table) - {"schema", "group", "ops", "aliases", "modules", "declared", "traits"}
    if unknown:
        raise UsageError(f"{origin}: unknown section(s) {', '.join(sorted(unknown))}")
    ops: dict[str, OpPolicy] = {}
    groups = table.get("group", [])
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise UsageError(f"{origin}: group must be an array of tables ([[group]])")
    for index, group in enumerate(groups):
        names = group.get("ops")
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise UsageError(f"{origin}: group #{index + 1} needs a non-empty ops list of op names (strings)")
        shared = {k: v for k, v in group.items() if k != "ops"}
        for kind in names:
            if kind in ops:
                raise UsageError(f"{origin}: op {kind!r} is listed twice")
            ops[kind] = _entry(kind, shared, origin, defaults)
    for kind, raw in _section(table, "ops", origin).items():
        if kind in ops and origin == "ops.toml":
            raise UsageError(f"{origin}: op {kind!r} is listed twice")
        ops[kind] = _entry(kind, raw, origin, defaults)
    aliases = {str(k): _op_name(v, f"{origin}: aliases.{k}") for k, v in _section(table, "aliases", origin).items()}
    modules = {str(k): _op_name(v, f"{origin}: modules.{k}") for k, v in _section(table, "modules", origin).items()}
    declared = _entry("declared", table["declared"], origin, defaults) if "declared" in table else None
    traits = {str(name): _trait(str(name), raw, origin) for name, raw in _section(table, "traits", origin).items()}
    return ops, aliases, modules, declared, traits


def _trait(name: str, raw: Any, origin: str) -> tuple[str | None, list[str]]:
    """(description or None, op kinds) of one [traits.NAME] table."""
    where = f"{origin}: traits.{name}"
    if not isinstance(raw, Mapping):
        raise UsageError(f"{where} must be a table with an ops list")
    unknown = set(raw) - {"description", "ops"}
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    kinds = raw.get("ops")
    if not isinstance(kinds, list) or not kinds or not all(isinstance(k, str) for k in kinds):
        raise UsageError(f"{where} needs a non-empty ops list of op names")
    description = raw.get("description")
    if description is not None and not isinstance(description, str):
        raise UsageError(f"{where}.description must be a string")
    return description, kinds


def _check_trait_ops(name: str, kinds: Iterable[str], ops: Mapping[str, OpPolicy], aliases: Mapping[str, str],
                     origin: str, error: type[Exception]) -> None:
    """A trait listing a name that no node's kind can be would silently do nothing: refuse it,
    naming the kind an alias stands for or the nearest kind."""
    for kind in kinds:
        if kind in ops:
            continue
        if kind in aliases:
            hint = f" (it is an alias of {aliases[kind]!r}: list that)"
        else:
            near = difflib.get_close_matches(kind, list(ops), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else " (`ampaudit ops` lists the kinds)"
        raise error(f"{origin}: traits.{name} lists {kind!r}, which is not an op kind{hint}")


def _section(table: Mapping[str, Any], key: str, origin: str) -> Mapping[str, Any]:
    section = table.get(key, {})
    if not isinstance(section, Mapping):
        raise UsageError(f"{origin}: {key} must be a table ([{key}]), not {type(section).__name__}")
    return section


def _op_name(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise UsageError(f"{where} must be an op name (a string), not {type(value).__name__}")
    return value


def _unknown_kinds(mapping: Mapping[str, str], ops: Mapping[str, OpPolicy], origin: str) -> None:
    """A module type or alias mapped to an op kind the catalog lacks would be silently
    'neutral': refuse it, naming the nearest kind."""
    for key, kind in mapping.items():
        if kind not in ops:
            near = difflib.get_close_matches(kind, list(ops), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else " (`ampaudit ops` lists the kinds)"
            raise UsageError(f"{origin}: {key} = {kind!r} is not an op kind{hint}")


@cache
def builtin_catalog() -> Catalog:
    """The catalog shipped with ampaudit (rules/ops.toml)."""
    ops, aliases, modules, declared, raw_traits = _parse(load_toml(rules_dir() / "ops.toml"), "ops.toml")
    missing = sorted({kind for kind in (*aliases.values(), *modules.values()) if kind not in ops})
    if missing:
        raise RuntimeError(f"ops.toml: aliases or modules point at unknown ops: {', '.join(missing)}")
    traits = {}
    for name, (description, kinds) in raw_traits.items():
        if not description or not description.strip():
            raise RuntimeError(f"ops.toml: traits.{name} needs a description")
        _check_trait_ops(name, kinds, ops, aliases, "ops.toml", RuntimeError)
        traits[name] = Trait(name, description.strip(), frozenset(kinds))
    return Catalog(ops, aliases, modules, declared, traits)


def load_catalog(policy_files: Iterable[Path] = (), tables: Iterable[tuple[Mapping, str]] = ()) -> Catalog:
    """The builtin catalog with pyproject tables, then ``--policy`` files, layered on top."""
    catalog = builtin_catalog()
    for table, origin in tables:
        catalog = catalog.merged(table, origin)
    for path in policy_files:
        if not str(path).strip():
            raise UsageError("an empty policy file path: name a TOML file")
        refuse_special_file(path, "policy file")  # a FIFO blocks, /dev/zero never ends
        try:
            table = load_toml(path)
        except FileNotFoundError:
            raise UsageError(f"policy file not found: {path}") from None
        except OSError as exc:
            raise UsageError(f"cannot read policy file {path}: {exc.strerror or exc}") from None
        except Exception as exc:  # tomllib.TOMLDecodeError
            raise UsageError(f"cannot read policy file {path}: {exc}") from None
        catalog = catalog.merged(table, str(path))
    return catalog


def build_catalog(config: Config, policy: str | Path | Mapping | None = None,
                  policy_files: Iterable[Path] = ()) -> Catalog:
    """The catalog a run uses: builtin, then the config's ``[tool.ampaudit.policy]``, then a
    ``policy`` argument (a table or a file) and ``--policy`` files."""
    tables: list[tuple[Mapping, str]] = []
    if config.policy:
        tables.append((config.policy, f"{config.source or 'pyproject.toml'} [tool.ampaudit.policy]"))
    files = list(policy_files)
    if isinstance(policy, Mapping):
        tables.append((policy, "policy argument"))
    elif policy is not None:
        files.append(Path(policy))
    return load_catalog(files, tables)
