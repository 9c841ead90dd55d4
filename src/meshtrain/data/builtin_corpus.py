"""The built-in corpus: real text present on every machine with no download.

``data.source = "builtin"`` trains on the running interpreter's own standard-library sources.
"""

from __future__ import annotations

import os
import sysconfig

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def _sorted_stdlib_sources(directory: str):
    """Yield ``.py`` files under ``directory`` in sorted relative-path order, lazily."""
    with os.scandir(directory) as scan:
        entries = sorted(scan, key=lambda e: e.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIPPED_DIRS:
                yield from _sorted_stdlib_sources(entry.path)
        elif entry.name.endswith(".py") and entry.is_file():
            yield entry.path


def builtin_corpus_texts(max_bytes: int) -> list[str]:
    """Real text present on every machine with no download: the standard library's own sources.

    Reads the running interpreter's ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` in
    sorted relative-path order, skipping ``site-packages`` and test directories, as UTF-8 (bad
    bytes replaced). It stops once ``max_bytes`` (UTF-8 bytes) are collected; the last file is cut
    at a character boundary so the total never exceeds ``max_bytes``. Deterministic for a given
    Python installation.
    """
    texts: list[str] = []
    remaining = max_bytes
    for filename in _sorted_stdlib_sources(sysconfig.get_paths()["stdlib"]):
        if remaining <= 0:
            break
        with open(filename, "rb") as handle:
            data = handle.read(remaining + 4)  # +4: a whole last character is decodable
        text = data.decode("utf-8", errors="replace")
        encoded = text.encode("utf-8")
        if len(encoded) > remaining:
            text = encoded[:remaining].decode("utf-8", errors="ignore")
            encoded = text.encode("utf-8")
        if text:
            texts.append(text)
            remaining -= len(encoded)
    return texts
