"""Loading a run's configuration: defaults, then a TOML (or ``config.json``) file, then
``--set section.key=value`` overrides.

Each value is parsed to its field's declared type (TOML with the standard library's ``tomllib``);
unknown sections and keys are refused with the closest valid name, wrong types with the type
expected. The sections themselves are :mod:`meshtrain.config.sections`.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
import typing
from pathlib import Path
from typing import Any

from meshtrain.config.sections import SECTION_NAMES, Config, ConfigError


def _did_you_mean(name: str, options: typing.Iterable[str]) -> str:
    matches = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f' Did you mean "{matches[0]}"?' if matches else ""


def _section(config: Config, section: str, origin: str) -> Any:
    if section not in SECTION_NAMES:
        raise ConfigError(
            f'{origin}: unknown section "{section}".{_did_you_mean(section, SECTION_NAMES)} '
            f"Valid sections: {', '.join(SECTION_NAMES)}."
        )
    return getattr(config, section)


def _field_types(obj: Any) -> dict[str, Any]:
    return typing.get_type_hints(type(obj))


def _coerce(value: Any, kind: type, key: str, origin: str) -> Any:
    """Convert a TOML value or an override string to the field's type."""
    bad = ConfigError(f'{origin}: {key} = {value!r} is not a valid {kind.__name__}.')
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{origin}: {key} = {value!r} is not a boolean; use true or false.")
    if kind is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                raise bad from None
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise bad
    if kind is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                raise bad from None
        else:
            raise bad
        if not math.isfinite(number):
            raise ConfigError(f"{origin}: {key} = {value!r} is not a finite number.")
        return number
    if kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if kind == list[str]:
        return _path_list(value, key, origin)
    if kind is list:
        return _weighted_paths(value, key, origin)
    if kind is dict:
        return _table(value, key, origin)
    raise bad


def _table(value: Any, key: str, origin: str) -> dict[str, Any]:
    """A table from TOML, a config.json object, or an override's text: a TOML inline table
    (``{rope_type = "llama3", factor = 8.0}``), a JSON object, or ``none`` / empty (no table)."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() in ("", "none", "{}"):
            return {}
        parsed = None
        try:
            parsed = json.loads(text)
        except ValueError:
            try:
                parsed = tomllib.loads(f"value = {text}")["value"]
            except tomllib.TOMLDecodeError:
                pass
        value = parsed
    if not isinstance(value, dict):
        raise ConfigError(f'{origin}: {key} must be a table, e.g. {key} = {{rope_type = "linear", '
                          f"factor = 2.0}} (or --set {key}.factor=2.0).")
    return dict(value)


def _weighted_paths(value: Any, key: str, origin: str) -> list[dict[str, Any]]:
    """``[{"path": str, "weight": float}, ...]`` from a TOML array of tables or from the
    ``PATH:WEIGHT,PATH:WEIGHT`` text of an override."""
    example = (f'{key} = [{{path = "a/", weight = 0.7}}, {{path = "b/", weight = 0.3}}] '
               f'(or --set {key}=a/:0.7,b/:0.3)')
    if isinstance(value, str):
        items = []
        for part in (p.strip() for p in value.split(",") if p.strip()):
            path, sep, weight = part.rpartition(":")
            if not sep:
                raise ConfigError(f"{origin}: {key}: {part!r} has no weight; write {example}.")
            items.append({"path": path, "weight": weight})
        value = items
    if not isinstance(value, list):
        raise ConfigError(f"{origin}: {key} = {value!r} is not a list of sources; write {example}.")
    out = []
    for item in value:
        if not isinstance(item, dict) or set(item) != {"path", "weight"}:
            raise ConfigError(f"{origin}: {key}: {item!r} must have exactly the keys path and "
                              f"weight; write {example}.")
        weight = _coerce(item["weight"], float, f"{key} weight", origin)
        out.append({"path": _coerce(item["path"], str, f"{key} path", origin), "weight": weight})
    return out


def _path_list(value: Any, key: str, origin: str) -> list[str]:
    """A list of paths from a TOML array of strings or an override's comma-separated text."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f'{origin}: {key} = {value!r} is not a list of paths; write {key} = '
                          f'["site_a/", "site_b/"] (or --set {key}=site_a/,site_b/).')
    return list(value)


def set_key(config: Config, dotted: str, value: Any, origin: str = "--set") -> None:
    """Set ``section.key`` on ``config`` to ``value`` parsed as the field's type."""
    if "." not in dotted:
        raise ConfigError(
            f'{origin}: "{dotted}" must be written section.key (sections: '
            f"{', '.join(SECTION_NAMES)}), e.g. model.dim=128."
        )
    section_name, key = dotted.split(".", 1)
    section = _section(config, section_name, origin)
    types = _field_types(section)
    table, _, entry = key.partition(".")
    if entry and types.get(table) is dict:  # one entry of a table: model.rope_scaling.factor=8
        current = dict(getattr(section, table))
        current[entry] = _table_entry(value)
        setattr(section, table, current)
        return
    if key not in types:
        raise ConfigError(
            f'{origin}: unknown key "{section_name}.{key}".{_did_you_mean(key, types)} '
            f"Valid keys in [{section_name}]: {', '.join(types)}."
        )
    setattr(section, key, _coerce(value, types[key], f"{section_name}.{key}", origin))


def _table_entry(value: Any) -> Any:
    """An override's text as a TOML value (number, boolean, quoted string), else the text."""
    if not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"value = {value}")["value"]
    except tomllib.TOMLDecodeError:
        return value


def config_from_dict(data: dict[str, Any], origin: str = "config") -> Config:
    """Build a config from a nested dict (a run's ``config.json``), refusing unknown sections and
    keys and wrong types."""
    config = Config()
    apply_mapping(config, data, origin)
    return config


def apply_mapping(config: Config, data: dict[str, Any], origin: str) -> None:
    """Apply a nested ``{section: {key: value}}`` mapping (e.g. a parsed TOML file)."""
    for section_name, values in data.items():
        _section(config, section_name, origin)
        if not isinstance(values, dict):
            raise ConfigError(f'{origin}: "{section_name}" must be a table ([{section_name}]).')
        for key, value in values.items():
            set_key(config, f"{section_name}.{key}", value, origin)


#: What ``meshtrain estimate`` needs from ``--set`` alone (no ``--config``, no ``--model``):
#: the model's shape, its vocabulary, the batch and the precision. Every other key keeps its
#: documented default (:class:`meshtrain.config.ModelConfig`: multi-head attention, SwiGLU, untied
#: embeddings).
REQUIRED_WITHOUT_CONFIG = ("model.dim", "model.n_layers", "model.n_heads", "model.ffn_dim",
                           "model.vocab_size", "train.seq_len", "train.global_batch",
                           "train.precision")


def parse_override(text: str) -> tuple[str, str]:
    """Split one ``--set`` argument ``section.key=value``."""
    if "=" not in text:
        raise ConfigError(f'--set "{text}": expected section.key=value, e.g. model.dim=128.')
    key, value = text.split("=", 1)
    return key.strip(), value.strip()


def load_config(path: str | Path | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults, then the file at ``path`` (if any: TOML, or JSON for a ``.json`` file such as
    the ``config.json`` of a run or of ``meshtrain convert --from-hf``), then ``--set``
    overrides, in order."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist (or is not a file).")
        if path.suffix == ".json":  # a run's or a converted checkpoint's config.json
            try:
                data = json.loads(path.read_text())
            except (ValueError, UnicodeDecodeError) as error:
                raise ConfigError(f"config file {path} is not valid JSON: {error}.") from None
            if not isinstance(data, dict):
                raise ConfigError(f"config file {path} must hold a JSON object of sections.")
        else:
            try:
                data = tomllib.loads(path.read_text())
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
                raise ConfigError(f"config file {path} is not valid TOML: {error}.") from None
        apply_mapping(config, data, str(path))
    for text in overrides:
        key, value = parse_override(text)
        set_key(config, key, value)
    return config


def default_config_path() -> Path | None:
    """The demo config shipped in ``configs/demo.toml`` (or packaged beside this module)."""
    package = Path(__file__).resolve().parents[1]  # src/meshtrain
    candidates = [package.parents[1] / "configs" / "demo.toml", package / "configs" / "demo.toml"]
    return next((c for c in candidates if c.is_file()), None)
