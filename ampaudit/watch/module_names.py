"""The names watch gives modules and parameters: qualified as the user wrote the model
("blocks.2.proj"), "(model)" for the model itself, a class name for a further root that
``ampaudit run``'s global hooks find (a loss module, a GAN's second network), and a number
per module for what a compiled graph records by. Keyed by ``id()``, each only while its
object lives: an address reused by a new object never inherits a dead one's name.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch


def user_name(name: str) -> str:
    """A module's name as the user wrote the model: torch.compile's wrapper adds ``_orig_mod`` -
    around the model, or around a block the script compiled (``blocks[i] = torch.compile(b)``)."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _forget(key: int, tables: tuple[dict, ...], _: weakref.ref) -> None:
    """A named module or parameter died: its id leaves the tables that name it."""
    for table in tables:
        table.pop(key, None)


class ModuleNames:
    """Names of the modules and parameters of the roots ``name_tree`` was given.

    ``by_id`` (id(module) -> name) is what the hooks' hot path reads; ``numbers`` and
    ``numbered`` map a module to its place in the list a compiled graph records by."""

    def __init__(self) -> None:
        self.by_id: dict[int, str] = {}  # id(module) -> qualified name
        self._roots: dict[str, weakref.ref] = {}  # a further root's name -> that root (``root_name``)
        self._main: weakref.ref | None = None  # global mode: the root named "(model)" (``root_prefix``)
        self.numbers: dict[int, int] = {}  # id(module) -> its place in ``numbered``
        self.numbered: list[str] = []
        self._number_of: dict[str, int] = {}  # a name's place in ``numbered``: a module named as a dead one shares it
        self._param_names: dict[int, str] = {}
        self._unnamed = 0  # parameters named ``param<k>`` so far (``param``)
        self._param_owners: dict[int, list[str]] = {}  # id(param) -> the modules holding it (tied: several)
        # id(module or parameter) named above -> a weak reference that forgets the id when it dies
        self._alive: dict[int, weakref.ref] = {}

    def root_prefix(self, module: torch.nn.Module) -> str:
        """A root's prefix: "" - it is "(model)" - for the first that has a parameter to train
        while no other "(model)" lives, else ``root_name``. A frozen EMA teacher that runs
        before its student (DINO, MoCo) or an augmentation module called on the batch is no
        more "(model)", its student's modules no more named by class - nor the teacher's
        grad-disabled calls counted as the model's eval forwards."""
        if (self._main is None or self._main() is None) and any(p.requires_grad for p in module.parameters()):
            self._main = weakref.ref(module)
            return ""
        return self.root_name(module)

    def root_name(self, module: torch.nn.Module) -> str:
        """A further root's name: its class's, numbered (``Sequential#2``) while another root
        of that name is alive - a GAN's two ``nn.Sequential`` were one module. A loss module
        made anew each step takes its dead predecessor's name."""
        base = name = type(module).__name__
        while (known := self._roots.get(name)) is not None and known() not in (None, module):
            name = f"{base}#{int(name.rpartition('#')[2]) + 1 if name != base else 2}"
        self._roots[name] = weakref.ref(module)
        return name

    def name_tree(self, root: torch.nn.Module, prefix: str) -> None:
        """Qualified names relative to ``root`` ("blocks.2.proj"); the root itself is
        "(model)", or ``prefix`` for further roots (a loss module called on its own)."""
        for raw, module in root.named_modules(remove_duplicate=False):
            if raw == "_orig_mod" or raw.endswith("._orig_mod"):
                # torch.compile's inner copy of a compiled module (the root, or a block compiled on
                # its own) returns the wrapper's own output, which the wrapper records: named, it
                # would count it twice wherever it runs outside the graph (dynamo falling back to
                # eager for the module's frame)
                continue
            name = user_name(raw)
            label = f"{prefix}.{name}" if prefix and name else name or prefix or "(model)"
            self._while_alive(module)
            label = self.by_id.setdefault(id(module), label)
            if id(module) not in self.numbers:  # numbered for a compiled graph
                self.numbers[id(module)] = number = self._number_of.setdefault(label, len(self.numbered))
                if number == len(self.numbered):
                    self.numbered.append(label)
        for name, param in root.named_parameters(remove_duplicate=False):
            name = user_name(name)
            self._while_alive(param)
            self._param_names.setdefault(id(param), f"{prefix}.{name}" if prefix else name)
            owner = name.rpartition(".")[0]
            owner = f"{prefix}.{owner}" if prefix and owner else owner or prefix or "(model)"
            if owner not in self._param_owners.setdefault(id(param), []):
                self._param_owners[id(param)].append(owner)

    def name_root(self, module: torch.nn.Module) -> None:
        """Name a module first seen outside every other one (a root) with its tree."""
        self.name_tree(module, self.root_prefix(module))

    def _while_alive(self, obj: Any) -> None:
        """``obj``'s id keeps the name given to it only while ``obj`` lives: once it dies its
        address is reused - a loss module made anew each step, a model built again for the next
        trial - and the new object there would take its name (or, a root, never be named)."""
        key = id(obj)
        if key not in self._alive:
            self._alive[key] = weakref.ref(obj, functools.partial(
                _forget, key, (self._alive, self.by_id, self.numbers, self._param_names, self._param_owners)))

    def __len__(self) -> int:
        """How many named modules and parameters are alive."""
        return len(self._alive)

    def module(self, module: torch.nn.Module) -> str | None:
        return self.by_id.get(id(module))

    def param(self, param: torch.nn.Parameter) -> str:
        """``param``'s name; one no module named (an optimizer's parameter whose module never ran
        through ``__call__``: ``layer.forward(x)``) is ``param<k>``, numbered in the order first
        asked and kept while it lives (numbered per optimizer, two optimizers' parameters would
        share names, their rows added up under them)."""
        name = self._param_names.get(id(param))
        if name is None:
            self._while_alive(param)
            name = self._param_names[id(param)] = f"param{self._unnamed}"
            self._unnamed += 1
        return name

    def param_owners(self, name: str) -> list[str]:
        """The modules that hold the parameter called ``name`` (a tied weight: each of them)."""
        for key, known in list(self._param_names.items()):  # a dead parameter's callback may pop one
            if known == name:
                return self._param_owners.get(key, [])
        return []
