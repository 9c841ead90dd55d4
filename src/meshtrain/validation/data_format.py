"""``data.format``, ``data.train_on`` and ``data.chat_template``, checked before launch.

Chat and prompt_completion data are ``.jsonl`` rows (docs/data.md): a raw source of any other
kind is refused, and chat data needs a chat template that loads and parses (from
``data.chat_template`` or beside ``data.tokenizer``). A prepared directory keeps the format it
was prepared with, so it is not checked against ``data.format``. Rows are checked when they are
tokenized: a bad one stops the run naming its file and line.
"""

from __future__ import annotations

from pathlib import Path

from meshtrain.config import Config, ConfigError
from meshtrain.config.sections import DATA_FORMATS, TRAIN_ON


def _choices(values: tuple[str, ...]) -> str:
    return ", ".join(f'"{value}"' for value in values)


def validate_data_format(config: Config) -> None:
    """Refuse (:class:`ConfigError` naming the key and the valid values) an unknown format or
    ``train_on``, a chat template given for another format or one that cannot be loaded, and a
    raw source other than ``.jsonl`` files for chat / prompt_completion data."""
    data = config.data
    if data.format not in DATA_FORMATS:
        raise ConfigError(f'data.format = "{data.format}" is not a data format; valid: '
                          f"{_choices(DATA_FORMATS)}.")
    if data.train_on not in TRAIN_ON:
        raise ConfigError(f'data.train_on = "{data.train_on}" is not valid; valid: '
                          f"{_choices(TRAIN_ON)} (the tokens the loss is taken on).")
    if data.chat_template and data.format != "chat":
        raise ConfigError(f'data.chat_template is set but data.format = "{data.format}"; the '
                          'template renders chat data only: set data.format = "chat" or clear '
                          "data.chat_template.")
    if data.format == "text":
        return
    if data.format == "chat":
        from meshtrain.data.chat_template import load_chat_template

        load_chat_template(data.chat_template, data.tokenizer)
    from meshtrain.validation.preflight import token_sources

    for key, source in token_sources(config):
        _check_rows_source(key, source, data.format)


def _check_rows_source(key: str, source: str, data_format: str) -> None:
    """A raw source of chat / prompt_completion data holds ``.jsonl`` files only."""
    from meshtrain.data.prepared import is_prepared_dir
    from meshtrain.data.readers import BUILTIN_SOURCE, find_source_files

    if source == BUILTIN_SOURCE:
        raise ConfigError(f'data.format = "{data_format}" reads .jsonl rows, but {key} is the '
                          'built-in corpus (plain text); give .jsonl files or use data.format = '
                          '"text".')
    if is_prepared_dir(Path(source).expanduser()):
        return  # its format was fixed by meshtrain prepare --format
    for path in find_source_files(source):
        if path.suffix.lower() != ".jsonl":
            raise ConfigError(f'data.format = "{data_format}" reads .jsonl rows (one JSON object '
                              f"per line), but {key} holds {path}; give .jsonl files, or prepare "
                              "other sources separately as text and mix the prepared "
                              "directories (data.sources).")
