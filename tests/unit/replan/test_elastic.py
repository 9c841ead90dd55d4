"""``parallel.elastic`` (:mod:`meshtrain.replan.elastic`): when a start re-plans, what it chooses
and
records, and what it refuses. No processes: a checkpoint is stood in for by its manifest."""

from __future__ import annotations

import json

import pytest

from meshtrain.config import Config, ConfigError, config_from_dict
from meshtrain.replan import elastic
from meshtrain.replan.layout_change import take_change
from meshtrain.validation.run_config import validate_config


@pytest.fixture(autouse=True)
def _no_calibration(monkeypatch, tmp_path):
    """The built-in CPU figures, whatever this machine has calibrated."""
    monkeypatch.setenv("MESHTRAIN_PROFILE", str(tmp_path / "no-profile.json"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    take_change()


def _config(tmp_path, **parallel) -> Config:
    config = config_from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
        "train": {"seq_len": 16, "global_batch": 4, "run_dir": str(tmp_path / "run"),
                  "device": "cpu", "precision": "fp32"},
        "data": {"max_bytes": 200000},
        "checkpoint": {"every": 1, "resume": "auto"},
        "parallel": {"dp": 2, "tp": 2, "elastic": True, **parallel},
    })
    return config


def _fake_checkpoint(tmp_path, step: int, **layout) -> None:
    """A checkpoint directory whose manifest verifies (it lists no files) and has ``layout``."""
    directory = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    directory.mkdir(parents=True)
    saved = {"world_size": 4, "dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 1, "zero": 0,
             "replicas": 1, **layout}
    (directory / "manifest.json").write_text(json.dumps(
        {"format": "meshtrain-dcp-1", "step": step, "files": {}, "model": {}, "layout": saved}))


def test_lost_node_replans_for_the_remaining_world(tmp_path, capsys):
    _fake_checkpoint(tmp_path, 5)
    config = _config(tmp_path)
    elastic.adapt(config, 2, in_job=True)
    par = config.parallel
    assert par.dp * par.tp * par.pp == 2
    assert config.train.global_batch % (par.dp * par.microbatches) == 0
    assert validate_config(config, 2) == 2
    change = take_change()
    assert change["from"] == {"dp": 2, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "zero": 0,
                              "world_size": 4}
    assert change["to"]["world_size"] == 2 and change["predicted_step_s"] > 0
    assert "checkpoint step_00000005" in change["reason"]
    assert take_change() is None  # handed over once
    err = capsys.readouterr().err
    assert "meshtrain: elastic: layout dp=2 tp=2 pp=1 (4 processes) -> " in err
    assert "WORLD_SIZE 2 differs from the 4 processes checkpoint step_00000005 was saved at" in err


def test_same_world_as_the_checkpoint_changes_nothing(tmp_path, capsys):
    _fake_checkpoint(tmp_path, 3)
    config = _config(tmp_path)
    elastic.adapt(config, 4, in_job=True)
    assert (config.parallel.dp, config.parallel.tp) == (2, 2)
    assert take_change() is None
    assert capsys.readouterr().err == ""


def test_nodes_back_return_to_the_configured_layout(tmp_path):
    _fake_checkpoint(tmp_path, 7, world_size=2, dp=1, tp=2)
    config = _config(tmp_path)
    elastic.adapt(config, 4, in_job=True)
    assert (config.parallel.dp, config.parallel.tp) == (2, 2)
    change = take_change()
    assert change["how"] == "the config's own layout fits"
    assert change["from"]["world_size"] == 2 and change["to"]["world_size"] == 4


def test_without_checkpoint_the_config_is_the_reference(tmp_path):
    config = _config(tmp_path)
    elastic.adapt(config, 2, in_job=True)
    change = take_change()
    assert "the config's layout needs" in change["reason"]
    assert config.parallel.dp * config.parallel.tp == 2


@pytest.mark.parametrize("overrides, section, words", [
    ({"every": 0}, "checkpoint", "checkpoint.every"),
    ({"resume": "/some/step_00000001"}, "checkpoint", "checkpoint.resume"),
    ({"replicas": 2, "dp": 1}, "parallel", "parallel.replicas"),
    ({"pp": 2, "pp_split": "1,1", "dp": 1}, "parallel", "pp_split"),
])
def test_refused_where_it_cannot_work(tmp_path, overrides, section, words):
    config = _config(tmp_path)
    for key, value in overrides.items():
        setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        elastic.adapt(config, 2, in_job=True)


def test_workers_store_prefix_follows_the_rendezvous_round(monkeypatch):
    """A node that joins restarts the workers without counting a restart (and the joining agent
    counts from 0): the workers' store prefix is the c10d rendezvous round, which all share."""
    import base64
    import pickle

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    from meshtrain.parallel.mesh import _attempt_key

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    store = dist.HashStore()
    assert _attempt_key(store) == "attempt_1"  # no rendezvous state: the restart count
    state = _RendezvousState()
    state.round = 3
    store.set("torch.rendezvous.job", base64.b64encode(pickle.dumps(state)))
    assert _attempt_key(store) == "round_3"


def test_with_parallel_auto_the_planner_chooses_on_every_change(tmp_path):
    _fake_checkpoint(tmp_path, 5)
    config = _config(tmp_path, auto=True)
    elastic.adapt(config, 2, in_job=True)
    change = take_change()
    assert change["how"].startswith("planned over ")
    assert config.parallel.dp * config.parallel.tp * config.parallel.pp == 2
    assert validate_config(config, 2) == 2
