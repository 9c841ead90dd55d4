"""TensorBoard: event files in ``RUN_DIR/tensorboard`` (``train.loggers = ["tensorboard"]`` or
``train.tensorboard = true``), written with ``torch.utils.tensorboard``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshtrain.training.trackers.base import Tracker


class TensorBoardTracker(Tracker):
    """Scalars under the names of :func:`~meshtrain.training.trackers.base.scalars`; the config
    and the final weights' path as text."""

    name = "tensorboard"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_config(self, config: dict[str, Any]) -> None:
        """The config as one JSON text (indented four spaces: Markdown shows it as code)."""
        text = json.dumps(config, indent=2).replace("\n", "\n    ")
        self.writer.add_text("config", "    " + text, 0)

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """One scalar per value at ``step``."""
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def log_final_weights(self, path: Path) -> None:
        """The directory as text under ``final_weights``."""
        self.writer.add_text("final_weights", str(path), 0)

    def close(self, status: str) -> None:
        """Flush the event file."""
        self.writer.close()
