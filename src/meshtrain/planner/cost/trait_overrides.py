"""``--trait NAME=VALUE``: a stack's runtime traits as one run configured them.

A stack (``--stack``, :data:`meshtrain.planner.cost.workload.STACKS`) prices what its software
did by default; a published run often changed some of it (Megatron-Bridge's H100 recipes turn
tensor-parallel overlap off and overlap the expert all-to-alls, NeMo's runs reduce gradients in
bf16). ``estimate`` and ``plan`` take ``--trait`` for each such setting, so any run can be priced
as it ran, and :func:`trait_arguments` writes the options that turn one traits value into
another (``python -m meshtrain.planner.tables.published --commands`` prints every validation
row's command this way).
"""

from __future__ import annotations

import dataclasses

from meshtrain.config import ConfigError
from meshtrain.config.layout import PP_SCHEDULES
from meshtrain.planner.cost.runtime import RuntimeTraits

NOT_SETTABLE = {"kernel_efficiency": "a stack's fitted kernel efficiency: give measured rates "
                                     "with --hardware a calibrate --out file instead"}
"""Traits ``--trait`` refuses, and what to do instead."""

CHOICES = {"selective_policy": ("modules", "op"), "pp_schedules": PP_SCHEDULES,
           "checkpointing": ("none", "selective", "full"), "zero_stages": (0, 1, 2, 3)}
"""The values a string trait, or each element of a list trait, may take."""

FIELDS = {f.name: f for f in dataclasses.fields(RuntimeTraits) if f.name not in NOT_SETTABLE}
"""The traits ``--trait`` sets, by name."""

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _default(name: str):
    return FIELDS[name].default


def _parse_value(name: str, text: str):
    default, value = _default(name), text.strip()
    if isinstance(default, bool):
        if value.lower() in _TRUE + _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"--trait {name}={text}: {name} is true or false.")
    if isinstance(default, tuple):
        element = type(default[0]) if default else str
        items = [item.strip() for item in value.split(",") if item.strip()]
        try:
            parsed = tuple(element(item) for item in items)
        except ValueError:
            raise ConfigError(f"--trait {name}={text}: a comma-separated list of "
                              f"{element.__name__} values, e.g. "
                              f"{','.join(map(str, default))}.") from None
        bad = [item for item in parsed if name in CHOICES and item not in CHOICES[name]]
        if not parsed or bad:
            raise ConfigError(f"--trait {name}={text}: each of "
                              f"{', '.join(map(str, CHOICES.get(name, ())))} (one or more, "
                              "comma-separated).")
        return parsed
    if isinstance(default, str):
        if name in CHOICES and value not in CHOICES[name]:
            raise ConfigError(f"--trait {name}={text}: one of {', '.join(CHOICES[name])}.")
        return value
    kind = float if FIELDS[name].type in ("float", float) else int
    try:
        number = kind(value)
    except ValueError:
        raise ConfigError(f"--trait {name}={text}: {name} is a number "
                          f"({kind.__name__}, e.g. {default}).") from None
    if number < 0:
        raise ConfigError(f"--trait {name}={text}: {name} must not be negative.")
    return number


def parse_trait(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` as ``(name, value)`` in the trait's type; :class:`ConfigError` naming the
    valid traits for an unknown name, and the valid values for a bad value."""
    name, sep, value = text.partition("=")
    name = name.strip()
    if not sep:
        raise ConfigError(f"--trait {text}: expected NAME=VALUE, e.g. tp_comm_overlap=false.")
    if name in NOT_SETTABLE:
        raise ConfigError(f"--trait {name}: not settable ({NOT_SETTABLE[name]}).")
    if name not in FIELDS:
        raise ConfigError(f"--trait {name}: unknown trait; valid: {', '.join(sorted(FIELDS))} "
                          "(meshtrain.planner.cost.runtime.RuntimeTraits documents each).")
    return name, _parse_value(name, value)


def apply_traits(traits: RuntimeTraits, texts: list[str] | None) -> RuntimeTraits:
    """``traits`` with every ``NAME=VALUE`` of ``texts`` applied (later ones win)."""
    changes = dict(parse_trait(text) for text in texts or ())
    return dataclasses.replace(traits, **changes) if changes else traits


def format_value(value) -> str:
    """A value as ``--trait`` (and ``--set``) take it (``true``, ``0,1``, ``12.0``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def trait_arguments(traits: RuntimeTraits, base: RuntimeTraits) -> list[str]:
    """The ``NAME=VALUE`` texts that :func:`apply_traits` needs to turn ``base`` into
    ``traits``; :class:`ValueError` when they differ in a trait ``--trait`` cannot set."""
    for name in NOT_SETTABLE:
        if getattr(traits, name) != getattr(base, name):
            raise ValueError(f"traits differ in {name}, which --trait cannot set")
    return [f"{name}={format_value(getattr(traits, name))}" for name in FIELDS
            if getattr(traits, name) != getattr(base, name)]
