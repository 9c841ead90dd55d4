"""Experiment trackers and harness scores during training, read back with the trackers' own
readers.

One run at pp 2 (two processes: the logging rank holds only the first stage, so the scored
model must be gathered from both) writes TensorBoard, W&B offline and MLflow's default SQLite
store and scores two local harness tasks every 2 steps. Afterwards ``metrics.jsonl`` holds the
task scores at steps 2 and 4, equal at step 4 to ``meshtrain eval`` on the final weights; the
W&B run file (parsed with W&B's protobuf records), the MLflow store (``MlflowClient``) and the
TensorBoard event file (TensorBoard's ``EventAccumulator``) each hold every step's loss and the
task scores; W&B and MLflow also the config and the final weights' path, and both runs ended as
finished."""

from __future__ import annotations

import json

import pytest

from tests.harness_tasks import (
    TINY_MODEL,
    wandb_finished_records,
    wandb_history,
    write_corpus,
    write_tasks,
    write_tokenizer,
)

pytest.importorskip("lm_eval")
pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "MLFLOW_TRACKING_URI",
               "MLFLOW_EXPERIMENT_NAME")


def test_trackers_hold_every_step_and_task_scores_under_pp2(tmp_path, meshtrain, monkeypatch):
    for name in TRACKER_ENV:  # the defaults: W&B offline, MLflow in the run directory
        monkeypatch.delenv(name, raising=False)
    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    corpus = write_corpus(tmp_path / "corpus.txt")
    tasks = write_tasks(tmp_path / "tasks")
    run = tmp_path / "run"
    overrides = (*TINY_MODEL, "parallel.pp=2", "parallel.microbatches=2",
                 f"data.source={corpus}", f"data.tokenizer={tokenizer}",
                 "train.loggers=tensorboard,wandb,mlflow", "train.eval_tasks=tiny_mc,tiny_gen",
                 "train.eval_tasks_every=2", f"train.eval_tasks_include={tasks}")
    done = meshtrain("train", "--nproc", "2", "--steps", "4", "--run-dir", str(run),
                     *[arg for pair in overrides for arg in ("--set", pair)])
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records}
    assert sorted(losses) == [1, 2, 3, 4]
    scored = {r["step"]: r["tasks"] for r in records if "tasks" in r}
    assert sorted(scored) == [2, 4] and set(scored[4]) == {"tiny_mc", "tiny_gen"}
    assert 0.0 <= scored[4]["tiny_mc"]["acc"] <= 1.0
    assert not (run / "task_eval").exists()  # the gathered copy is gone after scoring

    again = meshtrain("eval", str(run), "--tasks", "tiny_mc,tiny_gen", "--include-path",
                      str(tasks), "--output", str(tmp_path / "final.json"))
    assert again.returncode == 0, again.stderr
    final = json.loads((tmp_path / "final.json").read_text())["results"]
    assert scored[4]["tiny_mc"]["acc"] == final["tiny_mc"]["acc,none"]
    assert scored[4]["tiny_gen"]["exact_match"] == final["tiny_gen"]["exact_match,none"]
    final_weights = str((run / "final").resolve())
    ids = json.loads((run / "trackers.json").read_text())

    # W&B, offline under RUN_DIR/wandb: one run file, read record by record
    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    assert path.name == f"run-{ids['wandb']}.wandb"
    history = wandb_history(path)
    assert {row["_step"]: row["train/loss"] for row in history} == pytest.approx(losses)
    assert {row["_step"]: row["tasks/tiny_mc/acc"] for row in history
            if "tasks/tiny_mc/acc" in row} == {s: scored[s]["tiny_mc"]["acc"] for s in (2, 4)}
    config, summary, exit_code = {}, {}, None
    for record in wandb_finished_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item.key: json.loads(item.value_json)
                           for item in record.config.update})
        elif kind == "summary":
            summary.update({item.key: json.loads(item.value_json)
                            for item in record.summary.update if item.key})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert config["train"]["loggers"] == ["tensorboard", "wandb", "mlflow"]
    assert config["parallel"]["pp"] == 2
    assert summary["final_weights"] == final_weights
    assert exit_code == 0

    # MLflow: the SQLite store in the run directory, through its own client
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("meshtrain").experiment_id])
    assert found.info.run_id == ids["mlflow"] and found.info.status == "FINISHED"
    loss_history = client.get_metric_history(found.info.run_id, "train/loss")
    assert {m.step: m.value for m in loss_history} == pytest.approx(losses)
    acc_history = client.get_metric_history(found.info.run_id, "tasks/tiny_mc/acc")
    assert {m.step: m.value for m in acc_history} == {s: scored[s]["tiny_mc"]["acc"]
                                                      for s in (2, 4)}
    assert found.data.params["train.loggers"] == '["tensorboard", "wandb", "mlflow"]'
    assert found.data.params["parallel.pp"] == "2"
    assert found.data.tags["final_weights"] == final_weights
    assert [a.path for a in client.list_artifacts(found.info.run_id)] == ["config.json"]

    # TensorBoard: the event file in RUN_DIR/tensorboard, through TensorBoard's reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert {e.step: e.value for e in events.Scalars("train/loss")} == pytest.approx(losses)
    assert {e.step: e.value for e in events.Scalars("tasks/tiny_mc/acc")} == pytest.approx(
        {s: scored[s]["tiny_mc"]["acc"] for s in (2, 4)})
