"""``parallel.auto = true``: the planner picks the layout before ``train`` launches."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from meshtrain.config import load_config
from meshtrain.replan.auto import BUILTIN_CPU, choose_layout
from meshtrain.validation.run_config import validate_config

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_dim=64", "train.seq_len=16", "train.global_batch=8", "train.warmup_steps=0",
        "data.max_bytes=200000"]


def _sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


def test_train_auto_runs_the_chosen_layout(tmp_path):
    """No calibration file (an empty cache dir): a quick in-process measurement prices the
    layouts; the paragraph on stderr names the layout that then runs."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("MESHTRAIN_PROFILE", None)
    run = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--nproc", "2", "--steps", "2",
         "--run-dir", str(tmp_path / "run"), *_sets(TINY + ["parallel.auto=true"])],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    match = re.search(r"parallel\.auto chose dp=(\d+) tp=(\d+) pp=(\d+)", run.stderr)
    assert match, run.stderr
    assert "predicted" in run.stderr and "tokens/s" in run.stderr and "Runner-up" in run.stderr
    dp, tp, pp = map(int, match.groups())
    assert dp * tp * pp == 2
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["parallel"]
    assert (saved["dp"], saved["tp"], saved["pp"]) == (dp, tp, pp)
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 2


def test_auto_uses_the_given_profile_and_only_valid_layouts(tmp_path, capsys):
    """``parallel.auto_profile`` is used; layouts the runtime refuses (tp not dividing the
    vocabulary of 265 rows) are never chosen, and the choice passes the full validation."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(BUILTIN_CPU.to_dict()))
    config = load_config(None, TINY + ["parallel.auto=true", "model.vocab_size=265",
                                       f"parallel.auto_profile={profile}"])
    assert choose_layout(config, 4) == 4
    par = config.parallel
    assert par.tp == 1 and par.dp * par.pp == 4
    assert validate_config(config, 4) == 4
    err = capsys.readouterr().err
    assert f"from parallel.auto_profile {profile}" in err and f"dp={par.dp} tp={par.tp}" in err


def test_auto_profile_missing_exits_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--nproc", "2", "--run-dir", str(tmp_path),
         *_sets(TINY + ["parallel.auto=true", f"parallel.auto_profile={tmp_path}/none.json"])],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "parallel.auto_profile" in run.stderr and "Traceback" not in run.stderr


def test_auto_prices_the_configured_pipeline_split(monkeypatch):
    """``parallel.pp_split`` stays as configured, so every pipeline candidate is priced with
    that split (and only layouts it fits: here two stages), as the run will use it."""
    import importlib

    from meshtrain.planner.hardware.profile import Cluster
    from meshtrain.replan.auto import rank_layouts

    estimate_module = importlib.import_module("meshtrain.planner.cost.estimate")
    config = load_config(None, TINY + ["model.n_layers=4", "parallel.pp_split=3,1"])
    priced = []
    real = estimate_module.estimate

    def recording(workload, layout, cluster, **kwargs):
        priced.append(layout)
        return real(workload, layout, cluster, **kwargs)

    monkeypatch.setattr(estimate_module, "estimate", recording)
    chosen, _ = rank_layouts(config, 4, Cluster(BUILTIN_CPU, 4, 4, 1))
    piped = [lay for lay in priced if lay.pp > 1]
    assert piped and all(lay.pp_split == "3,1" and lay.pp * lay.chunks_per_rank == 2
                         for lay in piped)
    assert chosen and all(c.parallel.pp_split == "3,1" for _, c in chosen)


def test_calibrate_then_auto_names_the_calibrated_profile(tmp_path):
    """``meshtrain calibrate`` with no ``--out`` writes where ``parallel.auto`` looks (here
    ``$XDG_CACHE_HOME``, never the real ~/.cache), shows its progress and says where it wrote;
    ``train --set parallel.auto=true`` then prices with that file and says so."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    env.pop("MESHTRAIN_PROFILE", None)
    default = tmp_path / "cache" / "meshtrain" / "profile.json"
    calibrate = subprocess.run(
        [sys.executable, "-m", "meshtrain", "calibrate", "--sizes", "4096,65536",
         "--matmul-sizes", "64,128", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, env=env)
    assert calibrate.returncode == 0, calibrate.stderr
    assert default.is_file()
    assert "calibrate [1/8] round 1/5: GEMMs (64, 128)" in calibrate.stderr
    assert "calibrate [8/8] collectives of 64 KiB: all-reduce" in calibrate.stderr
    assert f"calibrate wrote {default} (parallel.auto uses it)" in calibrate.stderr
    run = subprocess.run(
        [sys.executable, "-m", "meshtrain", "train", "--nproc", "2", "--steps", "1",
         "--run-dir", str(tmp_path / "run"), *_sets(TINY + ["parallel.auto=true"])],
        capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    assert f"priced with measured from the calibration file {default}" in run.stderr
