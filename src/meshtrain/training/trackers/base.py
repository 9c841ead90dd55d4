"""The interface every experiment tracker implements, and what they all receive.

A tracker gets, from the logging rank only: the resolved config once at the start
(:meth:`Tracker.log_config`), every metrics row that ``metrics.jsonl`` gets, as flat scalars
(:meth:`Tracker.log_metrics`, names from :func:`scalars`), the final weights' directory once
they are written (:meth:`Tracker.log_final_weights`), and :meth:`Tracker.close` with how the run
ended (:data:`STATUSES`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

STATUSES = ("FINISHED", "FAILED", "KILLED")
"""How a run ended: trained to ``train.steps`` and saved its final weights; raised; or stopped
early by a signal or a re-plan (it goes on when resumed)."""

IDS_FILE = "trackers.json"
"""``RUN_DIR/trackers.json``: each tracker's run id, so that a resumed run logs to the same one."""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics row as flat ``name -> number`` pairs, the names every tracker uses.

    The step's own values are ``train/<key>`` (``train/loss``, ``train/grad_norm``, ``train/lr``,
    ``train/tokens_per_s``, ``train/mem/peak_bytes``, ``train/comm_bytes/dp``, ...); held-out
    evaluation is ``eval/loss`` and ``eval/ppl``; harness task scores are
    ``tasks/<task>/<metric>``. Values that are not numbers (``null``, text, booleans) are left
    out; ``step`` is the row's step, not a value."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        if key.startswith("eval_"):
            _flatten(out, f"eval/{key[5:]}", value)
        elif key == "tasks":
            _flatten(out, "tasks", value)
        else:
            _flatten(out, f"train/{key}", value)
    return out


def _flatten(out: dict[str, float], name: str, value: Any) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(out, f"{name}/{key}", inner)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[name] = float(value)


def flat_config(config: dict[str, Any]) -> dict[str, str]:
    """The config as ``section.key -> text`` (JSON for lists and tables), for trackers whose
    parameters are flat strings."""
    return {f"{section}.{key}": value if isinstance(value, str) else json.dumps(value)
            for section, values in config.items() for key, value in values.items()}


class Tracker(ABC):
    """One experiment tracker of a run, on the logging rank."""

    name: str = ""

    @abstractmethod
    def log_config(self, config: dict[str, Any]) -> None:
        """Record the run's resolved config (``Config.to_dict()``)."""

    @abstractmethod
    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Record one metrics row's :func:`scalars` at ``step``."""

    @abstractmethod
    def log_final_weights(self, path: Path) -> None:
        """Record where the final weights were written."""

    @abstractmethod
    def close(self, status: str) -> None:
        """Flush and end the tracker's run; ``status`` is one of :data:`STATUSES`."""

    def run_id(self) -> str | None:
        """The tracker's id of this run, kept in ``RUN_DIR/trackers.json`` (None: none)."""
        return None


def read_ids(run_dir: Path) -> dict[str, str]:
    """The tracker run ids an earlier launch of this run recorded (empty when none)."""
    try:
        ids = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in ids.items() if isinstance(v, str)} if isinstance(ids, dict) else {}


def write_ids(run_dir: Path, ids: dict[str, str]) -> None:
    """Record the tracker run ids of this run."""
    (run_dir / IDS_FILE).write_text(json.dumps(ids, indent=2) + "\n")
