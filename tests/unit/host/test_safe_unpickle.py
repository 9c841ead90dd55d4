"""The restricted unpickler (:mod:`meshtrain.host.safe_unpickle`): it resolves only the globals
its caller admits, refuses every other one before importing or calling it, and refuses (and
undoes) a pickle that sets attributes on an admitted class or function."""

from __future__ import annotations

import datetime
import io
import os
import pickle
import subprocess

import pytest

from meshtrain.host.safe_unpickle import (
    DisallowedGlobal,
    RestrictedUnpickler,
    restricted_load,
    restricted_loads,
)

DATA = frozenset({("datetime", "datetime"), ("datetime", "timezone"),
                  ("datetime", "timedelta"), ("builtins", "set"), ("builtins", "frozenset"),
                  ("fractions", "Fraction"), ("textwrap", "dedent")})


class _Calls:
    """Pickles as a call of ``target(*args)``: what a planted pickle does."""

    def __init__(self, target, *args):
        self.target, self.args = target, args

    def __reduce__(self):
        return self.target, self.args


def _global(module: str, name: str) -> bytes:
    """A protocol-0 pickle that only names ``module.name`` (GLOBAL, STOP)."""
    return f"c{module}\n{name}\n.".encode()


@pytest.mark.parametrize("target,args", [
    (os.system, ("touch {marker}",)),
    (eval, ("open({marker!r}, 'w')",)),
    (exec, ("open({marker!r}, 'w')",)),
    (subprocess.Popen, (["touch", "{marker}"],)),
    (__import__, ("os",)),
], ids=["os.system", "builtins.eval", "builtins.exec", "subprocess.Popen", "builtins.__import__"])
def test_a_call_of_anything_not_admitted_is_refused_and_nothing_runs(tmp_path, target, args):
    marker = tmp_path / "ran"
    args = tuple(a.format(marker=str(marker)) if isinstance(a, str) else
                 [x.format(marker=str(marker)) for x in a] if isinstance(a, list) else a
                 for a in args)
    data = pickle.dumps({"ok": [1, 2], "payload": _Calls(target, *args)})
    with pytest.raises(DisallowedGlobal) as refused:
        restricted_loads(data, DATA, "the test's pickle")
    assert not marker.exists()
    assert refused.value.module in (target.__module__, "posix", "nt")
    assert refused.value.name == target.__name__
    text = str(refused.value)
    assert text.startswith("the test's pickle refers to the global ")
    assert f"{refused.value.module}.{target.__name__}" in text


def test_the_plain_unpickler_would_have_run_it(tmp_path):
    """The payload of the test above is armed: pickle.loads runs it."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Calls(os.system, f"touch {marker}")))
    assert marker.exists()


def test_admitted_globals_build_their_data():
    when = datetime.datetime(2024, 5, 1, 12, tzinfo=datetime.UTC)
    value = {"when": when, "spans": [datetime.timedelta(seconds=3)], "set": {1, 2},
             "frozen": frozenset({"a"}), "tuple": (1, "x"), "bytes": b"\x00\xff"}
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):  # 2 spells bytes with a codec call
        assert restricted_loads(pickle.dumps(value, protocol=protocol), DATA) == value


def test_names_must_match_exactly():
    # a dotted name reaching through an admitted global, a sibling of it, and the module itself
    for module, name in [("datetime", "datetime.__init__"), ("datetime", "date"),
                         ("datetime", "sys"), ("fractions", "Fraction.from_float"),
                         ("builtins", "eval"), ("builtins", "getattr")]:
        with pytest.raises(DisallowedGlobal):
            restricted_loads(_global(module, name), DATA)


def test_a_persistent_id_is_refused():
    data = b"\x80\x02X\x01\x00\x00\x00xQ."  # PROTO 2, BINUNICODE 'x', BINPERSID, STOP
    with pytest.raises(pickle.UnpicklingError):
        restricted_loads(data, DATA)


@pytest.mark.parametrize("module,name", [("fractions", "Fraction"), ("textwrap", "dedent")],
                         ids=["a class", "a function"])
def test_setting_attributes_of_an_admitted_global_is_refused_and_undone(module, name):
    import importlib

    target = getattr(importlib.import_module(module), name)
    # GLOBAL module.name, state (None, {"evil": True}), BUILD: setattr on the class / function
    data = b"\x80\x04" + _global(module, name)[:-1] + b"N}\x8c\x04evil\x88s\x86b."
    with pytest.raises(DisallowedGlobal, match=f"changes attributes of {module}.{name}"):
        restricted_loads(data, DATA)
    assert not hasattr(target, "evil")
    try:  # the plain unpickler does set it: the pickle is armed
        pickle.loads(data)
        assert target.evil is True
    finally:
        del target.evil


def test_restricted_load_reads_a_file_and_the_class_is_an_unpickler():
    assert issubclass(RestrictedUnpickler, pickle.Unpickler)
    data = pickle.dumps([datetime.timedelta(days=1)])
    assert restricted_load(io.BytesIO(data), DATA) == [datetime.timedelta(days=1)]
    with pytest.raises(DisallowedGlobal):
        RestrictedUnpickler(io.BytesIO(data), set()).load()
