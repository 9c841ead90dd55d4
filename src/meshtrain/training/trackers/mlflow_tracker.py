"""MLflow (``train.loggers = ["mlflow"]``): a SQLite store in the run directory by default.

The tracking URI is ``MLFLOW_TRACKING_URI`` when set (a server, a ``sqlite:///`` file, or a
``file:`` store, which MLflow 3 accepts only with ``MLFLOW_ALLOW_FILE_STORE=true``), else
``sqlite:///RUN_DIR/mlflow.db``, with the artifacts (the config as ``config.json``) in
``RUN_DIR/mlflow-artifacts``: no server, no network (MLflow's usage telemetry is then off
unless ``MLFLOW_DISABLE_TELEMETRY`` says otherwise). The experiment is
``MLFLOW_EXPERIMENT_NAME`` (default ``meshtrain``), created when missing; the run is named after
the run directory. A resumed run logs to the same MLflow run (its id kept in
``RUN_DIR/trackers.json``). Read it back with ``MlflowClient`` or, with the full ``mlflow``
package, ``mlflow ui --backend-store-uri sqlite:///RUN_DIR/mlflow.db``.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from meshtrain.training.trackers.base import Tracker, flat_config

BATCH = 100
"""Most metrics or parameters one ``log_batch`` call carries (MLflow's own limit per request)."""

MAX_PARAM_CHARS = 6000
"""Longest parameter value MLflow stores; longer ones (long lists) are cut."""


def tracking_uri(run_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI`` when set, else the SQLite file ``RUN_DIR/mlflow.db``."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def metric_name(name: str) -> str:
    """``name`` with the characters MLflow refuses in a metric name replaced by ``_``."""
    return re.sub(r"[^\w\-. /:]", "_", name)


class MlflowTracker(Tracker):
    """One MLflow run through ``MlflowClient`` (no process-wide active run): the config as
    parameters and a ``config.json`` artifact, rows with ``log_batch`` at their step, the final
    weights' path as the tag ``final_weights``."""

    name = "mlflow"

    def __init__(self, run_dir: Path, run_id: str | None = None):
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # a local store: nothing leaves the host
            os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri(run_dir))
        if run_id is not None:
            try:  # the run an earlier launch of this run started, if this store has it
                self.client.update_run(run_id, status="RUNNING")
                self.run_id_ = run_id
                return
            except MlflowException:
                pass
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "meshtrain"
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            artifacts = None
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                artifacts = (run_dir / "mlflow-artifacts").resolve().as_uri()
            experiment_id = self.client.create_experiment(name, artifact_location=artifacts)
        run = self.client.create_run(experiment_id, run_name=run_dir.resolve().name)
        self.run_id_ = run.info.run_id

    def run_id(self) -> str | None:
        """The MLflow run id."""
        return self.run_id_

    def log_config(self, config: dict[str, Any]) -> None:
        """Every ``section.key`` as a parameter, and the whole config as ``config.json``."""
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id_).data.params
        params = [Param(key, value[:MAX_PARAM_CHARS])
                  for key, value in flat_config(config).items() if key not in existing]
        for start in range(0, len(params), BATCH):
            self.client.log_batch(self.run_id_, params=params[start:start + BATCH])
        self.client.log_dict(self.run_id_, config, "config.json")

    def log_metrics(self, step: int, values: dict[str, float]) -> None:
        """Each value as a metric at ``step``."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(metric_name(key), value, now, step) for key, value in values.items()]
        for start in range(0, len(metrics), BATCH):
            self.client.log_batch(self.run_id_, metrics=metrics[start:start + BATCH])

    def log_final_weights(self, path: Path) -> None:
        """The tag ``final_weights``."""
        self.client.set_tag(self.run_id_, "final_weights", str(path))

    def close(self, status: str) -> None:
        """End the run as ``FINISHED``, ``FAILED`` or ``KILLED``."""
        self.client.set_terminated(self.run_id_, status)
