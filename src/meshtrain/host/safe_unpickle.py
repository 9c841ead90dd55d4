"""Reading a pickle that came from outside this process without running anything it names.

A pickle is a program: ``pickle.load`` imports any module and calls any callable the bytes name
(``os.system``, ``subprocess.Popen``, ``builtins.eval``), so loading one from a file, a store or
the network runs whatever whoever wrote it chose. The pickles meshtrain cannot avoid reading are
written by torch in formats it does not control: the ``.metadata`` file of a
``torch.distributed.checkpoint`` checkpoint, and torch elastic's rendezvous state in the agent's
store. Both hold a few known data classes only, so they are read with
:class:`RestrictedUnpickler`, which resolves only the globals its caller names, exactly
(``(module, name)`` pairs), and refuses every other one with :class:`DisallowedGlobal` before it
is imported.

The admitted globals can still be *called* (REDUCE) and *have attributes set* (BUILD) by the
pickle. Callers admit only constructors of plain data, so the first builds data at worst; the
second could rewrite an admitted class or function for the rest of the process, so the loader
compares their attributes before and after and refuses (restoring them) a pickle that changed one.

Lives in ``host/`` (low in the tree, torch-free) because ``parallel/`` and ``checkpoint/`` both
use it; each keeps its own list of admitted globals beside the format it reads.
"""

from __future__ import annotations

import importlib
import io
import pickle
from collections.abc import Iterable
from typing import BinaryIO

Global = tuple[str, str]
"""``(module, qualified name)`` of an admitted global, as the pickle spells it."""


class DisallowedGlobal(pickle.UnpicklingError):
    """The pickle names a global its reader does not admit (nothing of it was imported or run),
    or it tried to change an admitted class or function."""

    def __init__(self, module: str, name: str, what: str = "a pickle", reason: str = ""):
        self.module, self.name, self.what = module, name, what
        super().__init__(reason or f"{what} refers to the global {module}.{name}, which it may "
                                   f"not hold; refused without importing or running it")


class RestrictedUnpickler(pickle.Unpickler):
    """A :class:`pickle.Unpickler` whose :meth:`find_class` resolves only the ``allowed``
    ``(module, name)`` pairs; ``what`` names the source in error messages. Persistent ids are
    refused too (the base class raises on them)."""

    def __init__(self, file: BinaryIO, allowed: Iterable[Global], what: str = "a pickle"):
        super().__init__(file, fix_imports=False)
        self.allowed = frozenset(allowed)
        self.what = what

    def find_class(self, module: str, name: str):
        """The admitted global ``module.name``; :class:`DisallowedGlobal` for any other."""
        if (module, name) not in self.allowed:
            raise DisallowedGlobal(module, name, self.what)
        return super().find_class(module, name)


def _resolve(module: str, name: str):
    target = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return target


def _attributes(allowed: Iterable[Global]) -> dict[Global, tuple[object, dict]]:
    """A shallow copy of the attributes of every admitted global that has them (classes,
    functions), by global; globals that do not resolve are left out (find_class will fail)."""
    found = {}
    for module, name in allowed:
        try:
            target = _resolve(module, name)
        except (ImportError, AttributeError):
            continue
        if isinstance(getattr(target, "__dict__", None), dict) or isinstance(target, type):
            found[(module, name)] = (target, dict(vars(target)))
    return found


def _undo_changes(before: dict[Global, tuple[object, dict]], what: str) -> None:
    """Raise :class:`DisallowedGlobal` (after putting every attribute back) when the load changed
    an attribute of an admitted class or function."""
    changed = None
    for (module, name), (target, saved) in before.items():
        now = vars(target)
        if now.keys() == saved.keys() and all(now[k] is saved[k] for k in saved):
            continue
        changed = changed or (module, name)
        for key in [k for k in now if k not in saved]:
            delattr(target, key)
        for key, value in saved.items():
            if key not in now or now[key] is not value:
                setattr(target, key, value)
    if changed is not None:
        module, name = changed
        raise DisallowedGlobal(module, name, what,
                               f"{what} changes attributes of {module}.{name}; refused "
                               "(the attributes are restored)")


def restricted_load(file: BinaryIO, allowed: Iterable[Global], what: str = "a pickle"):
    """The object pickled in ``file``, built from ``allowed`` globals only.

    Raises :class:`DisallowedGlobal` when the pickle names any other global, or changes an
    attribute of an admitted class or function; other malformed input raises what
    :mod:`pickle` raises (``UnpicklingError``, ``EOFError``, ...)."""
    allowed = frozenset(allowed)
    before = _attributes(allowed)
    try:
        return RestrictedUnpickler(file, allowed, what).load()
    finally:
        _undo_changes(before, what)


def restricted_loads(data: bytes, allowed: Iterable[Global], what: str = "a pickle"):
    """:func:`restricted_load` of the bytes ``data``."""
    return restricted_load(io.BytesIO(data), allowed, what)
