"""A run directory belongs to one run: the same ``meshtrain train`` twice is refused,
``--overwrite`` starts over, ``checkpoint.resume=auto`` continues the directory's own run, and a
longer resumed run continues its learning-rate schedule."""

from __future__ import annotations

import json

from tests.integration.test_cli import TINY, meshtrain_many

SMALL = [*TINY, "--set", "train.global_batch=4", "--set", "train.seq_len=32",
         "--set", "train.warmup_steps=2", "--set", "checkpoint.every=2"]


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_id(run_dir) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


def _checkpoint_ids(run_dir) -> set:
    return {json.loads((d / "manifest.json").read_text()).get("run_id")
            for d in (run_dir / "checkpoints").glob("step_*")}


def test_same_train_twice_is_refused_overwrite_starts_over_auto_resumes(tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "--steps", "4", "--run-dir", str(run_dir), *SMALL]
    first, again = meshtrain_many(train, train)
    assert first["returncode"] == 0, first["stderr"]
    first_id = _run_id(run_dir)
    assert _checkpoint_ids(run_dir) == {first_id}
    before = (run_dir / "metrics.jsonl").read_text()
    assert again["returncode"] == 2, again["stderr"]
    assert (f"this directory holds run {first_id} up to step 4: resume it with "
            "`--set checkpoint.resume=auto`, or choose another `--run-dir`, or `--overwrite` "
            "to start over") in " ".join(again["stderr"].split())  # the CLI wraps lines
    assert (run_dir / "metrics.jsonl").read_text() == before  # untouched

    (run_dir / "notes.txt").write_text("mine")  # not meshtrain's: --overwrite keeps it
    over, resumed = meshtrain_many(
        [*train[:2], "2", *train[3:], "--overwrite"],
        ["train", "--steps", "6", "--run-dir", str(run_dir), *SMALL,
         "--set", "checkpoint.resume=auto"])
    assert over["returncode"] == 0, over["stderr"]
    assert resumed["returncode"] == 0, resumed["stderr"]
    assert (run_dir / "notes.txt").read_text() == "mine"
    second_id = _run_id(run_dir)
    assert second_id != first_id
    assert _checkpoint_ids(run_dir) == {second_id}  # the first run's step 4 is gone
    assert "resumed from" in resumed["stderr"] and "step_00000002" in resumed["stderr"]
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3, 4, 5, 6]


def test_checkpoints_of_two_runs_are_refused(tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "--steps", "4", "--run-dir", str(run_dir), *SMALL]
    first, = meshtrain_many(train)
    assert first["returncode"] == 0, first["stderr"]
    own = _run_id(run_dir)
    manifest = run_dir / "checkpoints" / "step_00000002" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["run_id"] = "0123456789ab"  # a checkpoint of another run in the same directory
    manifest.write_text(json.dumps(data))
    resumed, = meshtrain_many([*train[:2], "6", *train[3:], "--set", "checkpoint.resume=auto"])
    assert resumed["returncode"] == 2, resumed["stderr"]
    assert "0123456789ab" in resumed["stderr"] and own in resumed["stderr"]
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3, 4]


def test_longer_resume_continues_the_learning_rate(tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "--steps", "20", "--run-dir", str(run_dir), *SMALL,
             "--set", "checkpoint.every=20", "--set", "train.warmup_steps=5"]
    first, resumed = meshtrain_many(
        train, [*train[:2], "40", *train[3:], "--set", "checkpoint.resume=auto"])
    assert first["returncode"] == 0, first["stderr"]
    assert resumed["returncode"] == 0, resumed["stderr"]
    assert ("train.steps 20 -> 40: the learning-rate schedule continues"
            in " ".join(resumed["stderr"].split()))
    lr = {r["step"]: r["lr"] for r in _metrics(run_dir)}
    assert sorted(lr) == list(range(1, 41))
    assert abs(lr[21] - lr[20]) <= 0.05 * lr[20]


def test_init_from_says_what_it_loaded(tmp_path):
    """``checkpoint.init_from`` confirms on stderr the path, the tensors it read and the step the
    weights were saved at."""
    source, target = tmp_path / "source", tmp_path / "target"
    first, second = meshtrain_many(
        ["train", "--steps", "2", "--run-dir", str(source), *SMALL],
        ["train", "--steps", "1", "--run-dir", str(target), *SMALL,
         "--set", f"checkpoint.init_from={source}"])
    assert first["returncode"] == 0, first["stderr"]
    assert second["returncode"] == 0, second["stderr"]
    said = " ".join(second["stderr"].split())
    assert f"started from the weights in {source} (" in said
    assert "tensors, saved at step 2)" in said


def test_auto_resume_without_checkpoints_says_it_starts_again(tmp_path):
    run_dir = tmp_path / "run"
    train = ["train", "--run-dir", str(run_dir), *SMALL, "--set", "checkpoint.every=0"]
    first, = meshtrain_many([*train, "--steps", "3"])
    assert first["returncode"] == 0, first["stderr"]
    again, = meshtrain_many([*train, "--steps", "4", "--set", "checkpoint.resume=auto"])
    assert again["returncode"] == 0, again["stderr"]
    said = " ".join(again["stderr"].split())
    assert (f"holds run {_run_id(run_dir)} up to step 3 but no checkpoint to resume from "
            "(checkpoint.every = 0); training it again from step 0") in said
    assert [r["step"] for r in _metrics(run_dir)] == [1, 2, 3, 4]
