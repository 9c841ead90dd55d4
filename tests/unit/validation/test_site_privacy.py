"""A site checks only its own data: preflight and validation of ``data.replica_sources`` open
the entry of the replica groups this launch runs, never another site's."""

from __future__ import annotations

import pytest

from meshtrain.config import ConfigError, config_from_dict
from meshtrain.validation.preflight import check_data_files, replica_groups_here, token_sources
from meshtrain.validation.run_config import validate_replica_sources

JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
            "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_NTASKS")


@pytest.fixture(autouse=True)
def _no_job(monkeypatch):
    for name in JOB_VARS:
        monkeypatch.delenv(name, raising=False)


def _config(tmp_path, **parallel):
    own = tmp_path / "site1.txt"
    own.write_text("def f():\n    return 1\n" * 400)
    missing = tmp_path / "site0-private" / "nothing-here.txt"  # another site's path
    return config_from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64},
        "train": {"seq_len": 16, "global_batch": 8, "steps": 4},
        "parallel": {"replicas": 2, "sync_every": 2, **parallel},
        "data": {"replica_sources": [str(missing), str(own)]},
    }), str(own)


def test_a_fault_tolerant_group_checks_its_own_source_only(tmp_path):
    config, own = _config(tmp_path, replica_fault_tolerance=True, replica_group=1)
    assert replica_groups_here(config) == [1]
    assert token_sources(config) == [("data.replica_sources[1]", own)]
    validate_replica_sources(config)  # group 0's path does not exist here: not looked at
    check_data_files(config)


def test_a_rank_of_a_launched_job_checks_its_group_only(tmp_path, monkeypatch):
    config, own = _config(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")  # ranks 2-3 are group 1 (replicas outermost)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert replica_groups_here(config) == [1]
    check_data_files(config)
    monkeypatch.setenv("RANK", "1")  # group 0: its own (missing) source is refused
    assert replica_groups_here(config) == [0]
    with pytest.raises(ConfigError, match="site0-private"):
        check_data_files(config)


def test_a_local_launch_of_every_group_checks_every_source(tmp_path):
    config, _ = _config(tmp_path)
    assert replica_groups_here(config) == [0, 1]
    with pytest.raises(ConfigError, match="site0-private"):
        check_data_files(config)
