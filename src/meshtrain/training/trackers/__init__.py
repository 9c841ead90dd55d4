"""Experiment trackers (``train.loggers``): TensorBoard, Weights & Biases and MLflow behind one
small interface (:class:`~meshtrain.training.trackers.base.Tracker`).

Only the logging rank opens them (:func:`open_trackers`), through the
:class:`~meshtrain.training.metrics.MetricsWriter` that writes ``metrics.jsonl``: each gets the
resolved config at the start, every row ``metrics.jsonl`` gets (eval and task scores included),
the final weights' directory, and how the run ended. Each one is an optional dependency, refused
before launch when missing (:mod:`meshtrain.validation.reporting`); their modules are imported
only when chosen.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from meshtrain.config import Config
from meshtrain.training.trackers.base import (
    STATUSES,
    Tracker,
    read_ids,
    scalars,
    write_ids,
)
from meshtrain.validation.reporting import chosen_loggers


class Trackers:
    """The trackers of one run, each called in turn."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def log_config(self, config: dict[str, Any]) -> None:
        """The resolved config, to each tracker."""
        for tracker in self.trackers:
            tracker.log_config(config)

    def log_row(self, record: dict[str, Any]) -> None:
        """One ``metrics.jsonl`` row, as :func:`~meshtrain.training.trackers.base.scalars`."""
        values = scalars(record)
        self._each(lambda tracker: tracker.log_metrics(int(record["step"]), values))

    def log_final_weights(self, path: Path) -> None:
        """The final weights' directory, to each tracker."""
        self._each(lambda tracker: tracker.log_final_weights(path))

    def _each(self, call) -> None:
        """``call`` each tracker; one that fails (a full disk, a server gone) is dropped with a
        warning, and training goes on: ``metrics.jsonl`` keeps every row."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as error:  # noqa: BLE001 - a tracker never stops a run
                self.trackers.remove(tracker)
                print(f"meshtrain: train.loggers: {tracker.name} failed ({type(error).__name__}: "
                      f"{error}); it gets nothing more of this run (metrics.jsonl has every row)",
                      file=sys.stderr, flush=True)
                try:
                    tracker.close("FAILED")
                except Exception:  # noqa: BLE001 - already reported
                    pass

    def close(self, status: str) -> None:
        """End every tracker's run with ``status`` (one of :data:`STATUSES`); each is closed
        even when another one fails, and the first failure is raised afterwards."""
        assert status in STATUSES, status
        failure = None
        for tracker in self.trackers:
            try:
                tracker.close(status)
            except Exception as error:  # noqa: BLE001 - close the others first
                failure = failure or error
        self.trackers = []
        if failure is not None:
            raise failure


def _open(name: str, run_dir: Path, run_id: str | None) -> Tracker:
    if name == "tensorboard":
        from meshtrain.training.trackers.tensorboard_tracker import TensorBoardTracker

        return TensorBoardTracker(run_dir)
    if name == "wandb":
        from meshtrain.training.trackers.wandb_tracker import WandbTracker

        return WandbTracker(run_dir, run_id)
    from meshtrain.training.trackers.mlflow_tracker import MlflowTracker

    return MlflowTracker(run_dir, run_id)


def open_trackers(config: Config, resuming: bool) -> Trackers:
    """Open the trackers ``train.loggers`` (and ``train.tensorboard``) name and give each the
    config. ``resuming``: continue the tracker runs ``RUN_DIR/trackers.json`` recorded (a fresh
    run starts new ones and records their ids)."""
    run_dir = Path(config.train.run_dir)
    names = chosen_loggers(config)
    if not names:
        return Trackers([])
    run_dir.mkdir(parents=True, exist_ok=True)
    earlier = read_ids(run_dir) if resuming else {}
    trackers = Trackers([])
    try:
        for name in names:
            trackers.trackers.append(_open(name, run_dir, earlier.get(name)))
        ids = {t.name: t.run_id() for t in trackers.trackers if t.run_id() is not None}
        if ids:
            write_ids(run_dir, ids)
        trackers.log_config(config.to_dict())
    except BaseException:
        trackers.close("FAILED")
        raise
    return trackers


__all__ = ["STATUSES", "Tracker", "Trackers", "open_trackers", "scalars"]
