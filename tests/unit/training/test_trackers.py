"""Experiment trackers and harness-task settings: the names a metrics row becomes, the
``train.tensorboard`` alias, ``--set train.loggers=...``, how a run's end reaches the trackers,
and every refusal before launch (unknown or uninstalled trackers, a missing harness, bad
``train.eval_tasks*`` values, a task whose data is not local). The harness model's generation
settings are checked here too."""

from __future__ import annotations

import sys

import pytest

from meshtrain.config import load_config
from meshtrain.training.metrics import MetricsWriter
from meshtrain.training.trackers import Trackers, scalars
from meshtrain.training.trackers.base import Tracker
from meshtrain.validation.reporting import chosen_loggers


def test_a_row_becomes_flat_named_numbers():
    record = {"step": 7, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-3, "mfu": None,
              "comm_bytes": {"dp": 10, "tp": 0}, "mem": {"peak_bytes": 99},
              "energy_source": "estimate", "straggler": None, "eval_loss": 2.0,
              "eval_ppl": 7.39, "tasks": {"mc": {"acc": 0.5, "acc/strict": 0.25}},
              "layout": {"dp": 2}, "nonfinite_skips": 0}
    assert scalars(record) == {
        "train/loss": 2.5, "train/grad_norm": 1.0, "train/lr": 1e-3,
        "train/comm_bytes/dp": 10.0, "train/comm_bytes/tp": 0.0, "train/mem/peak_bytes": 99.0,
        "eval/loss": 2.0, "eval/ppl": 7.39, "tasks/mc/acc": 0.5, "tasks/mc/acc/strict": 0.25,
        "train/layout/dp": 2.0, "train/nonfinite_skips": 0.0}


def test_loggers_parse_from_set_and_tensorboard_is_an_alias():
    config = load_config(None, ["train.loggers=tensorboard,wandb,mlflow"])
    assert config.train.loggers == ["tensorboard", "wandb", "mlflow"]
    assert chosen_loggers(config) == ["tensorboard", "wandb", "mlflow"]
    config = load_config(None, ["train.tensorboard=true", "train.loggers=mlflow"])
    assert chosen_loggers(config) == ["mlflow", "tensorboard"]
    assert chosen_loggers(load_config(None, ["train.tensorboard=true"])) == ["tensorboard"]
    assert chosen_loggers(load_config(None, [])) == []


class _Recorder(Tracker):
    name = "recorder"

    def __init__(self):
        self.calls = []

    def log_config(self, config):
        self.calls.append(("config", config))

    def log_metrics(self, step, values):
        self.calls.append(("metrics", step, values["train/loss"]))

    def log_final_weights(self, path):
        self.calls.append(("final", path.name))

    def close(self, status):
        self.calls.append(("close", status))


def _row(step):
    return {"step": step, "loss": 1.0 / step, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0}


def test_the_writer_passes_rows_the_final_weights_and_how_the_run_ended(tmp_path):
    finished, failed, stopped = _Recorder(), _Recorder(), _Recorder()
    writer = MetricsWriter(tmp_path / "a", 2, 0, Trackers([finished]))
    writer.log(_row(1))
    writer.log(_row(2))
    writer.final_weights(tmp_path / "a" / "final")
    writer.close()
    assert finished.calls == [("metrics", 1, 1.0), ("metrics", 2, 0.5), ("final", "final"),
                              ("close", "FINISHED")]
    writer = MetricsWriter(tmp_path / "b", 2, 0, Trackers([failed]))
    with pytest.raises(RuntimeError):
        try:
            writer.log(_row(1))
            raise RuntimeError("a rank died")
        finally:
            writer.close()
    assert failed.calls[-1] == ("close", "FAILED")
    writer = MetricsWriter(tmp_path / "c", 2, 0, Trackers([stopped]))  # stopped by a signal
    writer.log(_row(1))
    writer.close()
    assert stopped.calls[-1] == ("close", "KILLED")


def _said(done) -> str:
    return " ".join(done.stderr.split())


@pytest.mark.parametrize("overrides, message", [
    (["train.loggers=wandbb"], '"wandbb" is not a tracker meshtrain writes to. Did you mean '
                               '"wandb"?'),
    (["train.eval_tasks_every=-1", "train.eval_tasks=x"], "train.eval_tasks_every = -1"),
    (["train.eval_tasks_limit=-3", "train.eval_tasks=x"], "train.eval_tasks_limit = -3"),
    (["train.eval_tasks_every=5"], "take effect only with train.eval_tasks"),
    (["train.eval_tasks=x", "train.eval_tasks_include=/nonexistent/tasks"],
     'train.eval_tasks_include = "/nonexistent/tasks" is not a directory'),
])
def test_bad_values_are_refused(meshtrain, overrides, message):
    done = meshtrain("train", "--steps", "1", *[a for o in overrides for a in ("--set", o)])
    assert done.returncode == 2 and message in _said(done), done.stderr


@pytest.mark.parametrize("overrides, module, needs", [
    (["train.loggers=wandb"], "wandb", 'train.loggers = ["wandb"] needs the wandb package'),
    (["train.loggers=mlflow"], "mlflow", 'pip install "meshtrain[mlflow]"'),
    (["train.loggers=tensorboard"], "tensorboard", 'pip install "meshtrain[tensorboard]"'),
    (["train.eval_tasks=x"], "lm_eval", 'train.eval_tasks needs the lm-evaluation-harness'),
])
def test_missing_dependencies_are_refused(meshtrain, monkeypatch, overrides, module, needs):
    monkeypatch.setitem(sys.modules, module, None)  # import fails, as when not installed
    done = meshtrain("train", "--steps", "1", *[a for o in overrides for a in ("--set", o)])
    assert done.returncode == 2 and needs in _said(done), done.stderr
    assert "Traceback" not in done.stderr


def test_a_task_without_local_data_is_refused_before_launch(meshtrain, tmp_path):
    pytest.importorskip("lm_eval")
    (tmp_path / "remote.yaml").write_text(
        "task: remote_task\ndataset_path: nobody/not-on-this-machine\ntest_split: test\n"
        'output_type: multiple_choice\ndoc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\n'
        'doc_to_target: "{{a}}"\n')
    done = meshtrain("train", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                     "--set", "train.eval_tasks=remote_task",
                     "--set", f"train.eval_tasks_include={tmp_path}")
    assert done.returncode == 2, done.stderr
    said = _said(done)
    assert 'task "remote_task" could not be loaded' in said
    assert "train.eval_tasks_include" in said
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started


def test_generation_is_greedy_and_fits_the_context():
    pytest.importorskip("lm_eval")
    from meshtrain.config import ConfigError
    from meshtrain.training.harness.lm import _cut, _greedy_settings

    assert _greedy_settings({"until": "\n", "max_gen_toks": 5}) == (["\n"], 5)
    assert _greedy_settings({"until": [".", "!"], "max_new_tokens": 3}) == ([".", "!"], 3)
    assert _greedy_settings({"do_sample": False, "temperature": 0}) == ([], 256)
    with pytest.raises(ConfigError, match="decodes greedily"):
        _greedy_settings({"do_sample": True, "temperature": 0.7})
    assert _cut("a cat. a dog! more", [".", "!"]) == "a cat"
    assert _cut("no stop here", ["."]) == "no stop here"


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    from meshtrain.training.trackers import open_trackers
    from tests.harness_tasks import wandb_history

    for name in ("WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    config = load_config(None, [f"train.run_dir={tmp_path}", "train.loggers=mlflow,wandb"])
    first = open_trackers(config, resuming=False)
    first.log_row(_row(1))
    first.close("KILLED")  # stopped by a signal after step 1
    second = open_trackers(config, resuming=True)
    second.log_row(_row(2))
    second.close("FINISHED")

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("meshtrain").experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert {m.step: m.value for m in history} == {1: 1.0, 2: 0.5}
    files = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and files[0].name == files[1].name  # two launches, one run id
    assert [[row["_step"] for row in wandb_history(path)] for path in files] == [[1], [2]]


def test_a_failing_tracker_is_dropped_and_the_others_go_on(capsys):
    class Broken(_Recorder):
        name = "broken"

        def log_metrics(self, step, values):
            raise OSError("disk full")

    broken, fine = Broken(), _Recorder()
    trackers = Trackers([broken, fine])
    trackers.log_row(_row(1))
    trackers.log_row(_row(2))
    trackers.close("FINISHED")
    assert fine.calls == [("metrics", 1, 1.0), ("metrics", 2, 0.5), ("close", "FINISHED")]
    assert broken.calls == [("close", "FAILED")]
    assert "broken failed (OSError: disk full)" in capsys.readouterr().err
