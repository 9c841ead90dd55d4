"""``parallel.replan_every`` (:mod:`meshtrain.replan.on_measurement`,
:mod:`meshtrain.replan.measured`): what
the measured costs do to the planner's prices, the decision, the saved layout a restart picks up,
and what is refused. No processes: measurements are given, a checkpoint is its manifest."""

from __future__ import annotations

import json

import pytest

from meshtrain import faults
from meshtrain.config import Config, ConfigError, config_from_dict
from meshtrain.replan import on_measurement as replan
from meshtrain.replan.auto import job_cluster, predict
from meshtrain.replan.layout_change import take_change
from meshtrain.replan.measured import measured_cluster, measured_scales, planner_axes
from meshtrain.run.launch import restart_budget


@pytest.fixture(autouse=True)
def _no_calibration(monkeypatch, tmp_path):
    """The built-in CPU figures, whatever this machine has calibrated; no injected faults."""
    monkeypatch.setenv("MESHTRAIN_PROFILE", str(tmp_path / "no-profile.json"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    faults.reset()
    take_change()


def _config(tmp_path, **parallel) -> Config:
    return config_from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                  "vocab_size": 256},
        "train": {"seq_len": 16, "global_batch": 4, "run_dir": str(tmp_path / "run"),
                  "device": "cpu", "precision": "fp32", "steps": 8},
        "data": {"max_bytes": 200000},
        "checkpoint": {"every": 100},
        "parallel": {"dp": 2, "tp": 2, "replan_every": 3, **parallel},
    })


SLOW_TP = {"steps": 3, "step_s": 0.30, "axes": {"tp": 0.25, "dp": 0.01, "world": 0.5}}
"""A step of dp 2 x tp 2 whose tp collectives take 0.25 s (a slow tp link)."""


def test_measured_costs_price_the_running_layout_at_its_measured_time(tmp_path):
    """Every measured second is attributed (compute or an axis), and the scaled profile goes
    back through the planner's estimate: the running layout then costs what was measured,
    although the estimate composes compute and communication through the schedule."""
    config = _config(tmp_path)
    cluster, _ = job_cluster(config, 4, in_job=True)
    planned = predict(config, 4, cluster)
    axes = planner_axes(SLOW_TP["axes"])
    assert axes == {"dp": 0.01, "tp": 0.25, "pp": 0.0, "ep": 0.0, "cp": 0.0}  # world left out
    scales = measured_scales(planned, SLOW_TP["step_s"], axes)
    assert scales["tp"] > 5 * scales["dp"] > 5 and scales["compute"] > 0
    assert scales["pp"] == scales["dp"]  # not used here: priced like the least slowed link
    repriced = predict(config, 4, measured_cluster(cluster, scales))
    assert repriced["step_time_s"] == pytest.approx(SLOW_TP["step_s"], rel=1e-3)
    # the same costs price a layout without tp with no tp time at all
    dp4 = predict(_config(tmp_path, dp=4, tp=1), 4, measured_cluster(cluster, scales))
    assert dp4["breakdown"]["tp_comm_s"] == 0 and dp4["step_time_s"] < 0.5 * SLOW_TP["step_s"]


def test_slow_tp_decides_a_relaunch_without_tp(tmp_path):
    config = _config(tmp_path)
    record = replan.decide(config, 4, 4, SLOW_TP, done=0)
    assert record["decision"] == "relaunch" and record["replans"] == 1
    assert record["to"]["tp"] == 1 and record["to"]["world_size"] == 4
    assert record["to"]["dp"] * record["to"]["pp"] == 4
    assert record["gain"] > 0.10 and record["best"]["predicted_step_s"] < 0.27
    assert record["from"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 0,
                              "world_size": 4}
    assert record["measured_s"]["tp"] == 0.25
    text = record["message"]
    assert "meshtrain: replan: after step 4 at dp=2 tp=2 pp=1: measured 0.3 s/step" in text
    assert "tp 0.25 s (x" in text and "Decision: relaunch with it" in text


def test_a_gain_below_the_threshold_keeps_the_layout(tmp_path):
    config = _config(tmp_path, replan_gain=0.99)
    record = replan.decide(config, 4, 4, SLOW_TP, done=0)
    assert record["decision"] == "keep" and record["replans"] == 0 and "to" not in record
    assert "not more than parallel.replan_gain = 0.99" in record["why"]
    assert "Decision: keep the layout" in record["message"]


def _checkpoint(tmp_path, step: int) -> None:
    directory = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text(json.dumps(
        {"format": "meshtrain-dcp-1", "step": step, "files": {}, "model": {},
         "layout": {"world_size": 4, "dp": 2, "tp": 2, "pp": 1}}))


def test_a_restart_picks_up_the_saved_layout(tmp_path, monkeypatch, capsys):
    config = _config(tmp_path)
    decision = replan.decide(config, 4, 4, SLOW_TP, done=0)
    _checkpoint(tmp_path, 4)
    replan.write_decision(config, {**decision, "step": 4})
    fresh = _config(tmp_path)
    assert not replan.apply_saved(fresh, 4, verbose=True)  # resume = none: a new run
    assert replan.replans_done(fresh) == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not replan.apply_saved(_config(tmp_path), 2, verbose=False)  # another world
    restarted = _config(tmp_path)
    assert replan.apply_saved(restarted, 4, verbose=True)
    assert restarted.parallel.tp == 1
    assert restarted.parallel.dp * restarted.parallel.pp == 4
    assert replan.replans_done(restarted) == 1
    change = take_change()
    assert change["reason"] == "replan" and change["to"]["tp"] == 1
    assert "relaunched at dp=" in capsys.readouterr().err


def test_a_checkpoint_older_than_the_decision_keeps_the_config(tmp_path):
    config = _config(tmp_path)
    config.checkpoint.resume = "auto"
    decision = replan.decide(config, 4, 6, SLOW_TP, done=0)
    _checkpoint(tmp_path, 4)  # the decision's own checkpoint (step 6) never got written
    replan.write_decision(config, {**decision, "step": 6})
    assert not replan.apply_saved(config, 4, verbose=False)
    assert config.parallel.tp == 2


@pytest.mark.parametrize("section, key, value, words", [
    ("parallel", "replan_every", -1, "parallel.replan_every = -1 must be 0"),
    ("parallel", "replan_gain", 0.0, "parallel.replan_gain = 0 must be a fraction"),
    ("parallel", "replan_gain", 1.5, "parallel.replan_gain = 1.5 must be a fraction"),
    ("parallel", "replan_max", 0, "parallel.replan_max = 0 must be at least 1"),
    ("checkpoint", "every", 0, "parallel.replan_every needs periodic checkpoints"),
    ("checkpoint", "resume", "/some/step_00000001", "checkpoint.resume = '/some/step"),
    ("parallel", "pp_split", "1,1", "pp_split"),
    ("train", "steps", 4, "train.steps = 4 leaves no step after it"),
])
def test_refused_where_it_cannot_work(tmp_path, section, key, value, words):
    config = _config(tmp_path)
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        replan.validate_replan(config)


def test_torchrun_without_restarts_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    with pytest.raises(ConfigError, match="--max-restarts 1"):
        replan.validate_replan(_config(tmp_path))


def test_cli_exits_2_on_a_bad_gain(meshtrain, tmp_path):
    result = meshtrain("train", "--run-dir", str(tmp_path), "--steps", "8",
                       "--set", "parallel.replan_every=3", "--set", "parallel.replan_gain=2")
    assert result.returncode == 2
    assert "parallel.replan_gain = 2 must be a fraction" in result.stderr


def test_the_launcher_adds_the_relaunches_to_its_restarts(tmp_path):
    config = _config(tmp_path, replan_max=2)
    config.train.max_restarts = 3
    assert restart_budget(config) == 5
    config.parallel.replan_every = 0
    assert restart_budget(config) == 3


def test_slow_axis_fault_delays_only_its_axis(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "slow_axis:axis=tp:ms=30:step=2")
    faults.reset()
    assert faults.delay_collective(2, "tp") == pytest.approx(0.03)
    assert faults.delay_collective(1, "tp") == 0  # before its step
    assert faults.delay_collective(3, "dp") == 0
    with pytest.raises(ValueError, match="needs axis=NAME and ms=X"):
        faults.parse("slow_axis:ms=5")
