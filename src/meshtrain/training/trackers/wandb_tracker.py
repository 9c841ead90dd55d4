"""Weights & Biases (``train.loggers = ["wandb"]``): offline by default.

Unless ``WANDB_MODE`` chooses another mode (``online``, ``disabled``), the run is written
offline: ``RUN_DIR/wandb/offline-run-*/run-*.wandb``, no network, no account; ``wandb sync
RUN_DIR/wandb/offline-run-*`` uploads it later. ``WANDB_DIR`` moves the ``wandb/`` folder;
``WANDB_PROJECT`` (default ``meshtrain``), ``WANDB_ENTITY`` and ``WANDB_NAME`` (default: the
run directory's name) are read as W&B reads them. A resumed run logs to the same W&B run id
(kept in ``RUN_DIR/trackers.json``); offline, each launch writes a directory of its own and
``wandb sync`` joins them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from meshtrain.training.trackers.base import Tracker


def wandb_mode() -> str:
    """``WANDB_MODE`` when the user set it, else ``offline``."""
    return os.environ.get("WANDB_MODE") or "offline"


class WandbTracker(Tracker):
    """One W&B run: the config as its config, rows with ``run.log(step=...)``, the final weights'
    path in its summary (``final_weights``)."""

    name = "wandb"

    def __init__(self, run_dir: Path, run_id: str | None = None):
        import wandb

        directory = Path(os.environ.get("WANDB_DIR") or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "meshtrain",
            name=os.environ.get("WANDB_NAME") or run_dir.resolve().name,
            dir=str(directory), mode=wandb_mode(), id=run_id,
            resume="allow" if run_id else None)

    def run_id(self) -> str | None:
        """The W&B run id."""
        return self.run.id

    def log_config(self, config: dict[str, Any]) -> None:
        """The config, section by section, as the run's config."""
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """One history row at ``step``."""
        self.run.log(values, step=step)

    def log_final_weights(self, path: Path) -> None:
        """``final_weights`` in the run's summary."""
        self.run.summary["final_weights"] = str(path)

    def close(self, status: str) -> None:
        """Finish the run: exit code 0 when it finished, 1 otherwise."""
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
