"""``meshtrain bench``: the JSON document of a tiny run, argument errors, the suite registry."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtrain.bench import SUITES, Suite, format_table, register_suite
from meshtrain.cli import main

TINY = ["--set", "model.dim=32", "--set", "model.n_layers=2", "--set", "model.n_heads=4",
        "--set", "model.n_kv_heads=2", "--set", "model.ffn_dim=64", "--set", "train.seq_len=32",
        "--set", "train.global_batch=4", "--set", "data.max_bytes=200000"]

SIDES = ("meshtrain", "peer")


def _run_json(capsys, suite: str) -> dict:
    status = main(["bench", "--suite", suite, "--steps", "2", "--warmup", "0", "--repeats", "1",
                   "--json", *TINY])
    out, err = capsys.readouterr()
    assert status == 0, err
    results = json.loads(out)
    assert isinstance(results, list) and len(results) == 1
    return results[0]


def _check_result(result: dict, suite: str, world: int) -> None:
    assert result["suite"] == suite
    assert result["world_size"] == world
    assert isinstance(result["peer"], str) and result["peer"]
    for side in SIDES:
        assert isinstance(result[f"{side}_tokens_per_s"], float)
        assert result[f"{side}_tokens_per_s"] > 0
        assert isinstance(result[f"{side}_peak_bytes"], int) and result[f"{side}_peak_bytes"] > 0
        assert len(result[f"{side}_peak_bytes_per_rank"]) == world
        assert len(result[f"{side}_runs_tokens_per_s"]) == 1
        assert result[f"{side}_cpu_tokens_per_s"] > 0
    assert result["ratio"] == pytest.approx(
        result["meshtrain_tokens_per_s"] / result["peer_tokens_per_s"])
    assert result["cpu_ratio"] == pytest.approx(
        result["meshtrain_cpu_tokens_per_s"] / result["peer_cpu_tokens_per_s"])
    assert (result["steps"], result["warmup"], result["repeats"]) == (2, 0, 1)
    assert result["tokens_per_step"] == 4 * 32
    assert result["threads_per_process"] == 1
    assert result["shape"]["dim"] == 32 and result["shape"]["n_kv_heads"] == 2
    assert result["shape"]["seq_len"] == 32 and result["shape"]["global_batch"] == 4
    # Same data, same initial weights, same optimizer: both sides train the same numbers.
    assert result["meshtrain_first_loss"] == pytest.approx(result["peer_first_loss"], rel=1e-4)
    assert result["meshtrain_last_loss"] == pytest.approx(result["peer_last_loss"], rel=1e-3)


def test_single_suite_json(capsys):
    pytest.importorskip("transformers")
    _check_result(_run_json(capsys, "single"), "single", 1)


def test_dp_suite_json(capsys):
    _check_result(_run_json(capsys, "dp"), "dp", 2)


@pytest.mark.parametrize("args, message", [
    (["--suite", "singel"], 'Did you mean "single"'),
    (["--steps", "0"], "--steps = 0"),
    (["--repeats", "0"], "--repeats = 0"),
    (["--set", "model.dimm=8"], 'Did you mean "dim"'),
    (["--set", "train.precision=bf16"], "fp32"),
    (["--suite", "single", "--set", "model.mlp=gelu"], "SwiGLU"),
])
def test_usage_errors_exit_2(capsys, args, message):
    assert main(["bench", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_missing_peer_package_says_how_to_install(capsys, monkeypatch):
    missing = dataclasses.replace(SUITES["single"], requires=("meshtrain_no_such_module",))
    monkeypatch.setitem(SUITES, "single", missing)
    assert main(["bench", "--suite", "single"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # the message is wrapped at 100 columns
    assert "meshtrain_no_such_module" in err and "pip install -e '.[bench]'" in err


def test_registry_refuses_a_duplicate_name():
    with pytest.raises(ValueError, match="already registered"):
        register_suite(dataclasses.replace(SUITES["dp"]))
    assert all(isinstance(suite, Suite) for suite in SUITES.values())


def test_format_table_shows_every_suite():
    row = {"suite": "single", "world_size": 1, "peer": "peer X", "meshtrain_tokens_per_s": 900.0,
           "peer_tokens_per_s": 1000.0, "ratio": 0.9, "cpu_ratio": 0.95,
           "meshtrain_peak_bytes": 2 << 20, "peer_peak_bytes": 3 << 20, "repeats": 3,
           "steps": 20, "warmup": 2, "threads_per_process": 1}
    table = format_table([row, {**row, "suite": "dp", "world_size": 2}])
    assert "single" in table and "dp" in table and "0.900" in table and "2/3" in table
    assert "0.950" in table
