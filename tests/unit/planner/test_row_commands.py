"""Every validation row re-priced through its printed ``meshtrain estimate`` command, and
``--trait``'s parsing and refusals."""

import contextlib
import io
import json
import shlex

import pytest

from meshtrain.cli import main
from meshtrain.config import ConfigError
from meshtrain.planner.cost.runtime import MEGATRON_CORE_2024
from meshtrain.planner.cost.trait_overrides import apply_traits, parse_trait, trait_arguments
from meshtrain.planner.tables.published import evaluate, published_rows
from meshtrain.planner.tables.row_commands import row_command

ROWS = published_rows()


def _estimate(argv: list[str]) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--json"]) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_each_rows_command_prices_it_as_the_table_does(row):
    words = shlex.split(row_command(row))
    assert words[:2] == ["meshtrain", "estimate"]
    result = _estimate(words[1:])
    expected = evaluate(row)
    assert result[row.metric] == pytest.approx(expected["predicted"], rel=1e-9)
    assert result["memory_gb_per_gpu"] == pytest.approx(expected["memory_gb_per_gpu"], rel=1e-9)
    assert result["fits"] == expected["fits"]


def test_published_commands_lists_every_row(capsys):
    from meshtrain.planner.tables.published import main as published_main

    published_main(["--commands"])
    lines = capsys.readouterr().out.splitlines()
    commands = [line for line in lines if line.startswith("meshtrain estimate ")]
    assert len(commands) == len(ROWS)
    assert sum(line.startswith("# ") for line in lines) == len(ROWS)


def test_a_trait_changes_the_price_and_is_reported():
    base = ["estimate", "--model", "llama3.1-70b", "--hardware", "h100-80g", "--gpus", "64",
            "--stack", "megatron-core-2024", "--set", "parallel.tp=8",
            "--set", "parallel.sequence_parallel=true", "--set", "parallel.pp=2",
            "--set", "parallel.zero=1"]
    plain = _estimate(base)
    changed = _estimate([*base, "--trait", "tp_comm_overlap=false"])
    assert plain["traits"] == {} and changed["traits"] == {"tp_comm_overlap": False}
    # Exposing the tp all-reduces can only lengthen the step.
    assert changed["step_time_s"] > plain["step_time_s"]


def test_a_trait_wins_over_the_config_it_overlaps():
    base = ["estimate", "--model", "llama3.1-8b", "--hardware", "h100-80g", "--gpus", "8",
            "--stack", "megatron-core-2024", "--set", "parallel.zero=1"]
    bf16 = _estimate([*base, "--set", "parallel.grad_reduce_dtype=bf16"])
    both = _estimate([*base, "--set", "parallel.grad_reduce_dtype=bf16",
                      "--trait", "grad_reduce_bytes=4"])
    fp32 = _estimate(base)
    assert both["memory_gb_per_gpu"] == pytest.approx(fp32["memory_gb_per_gpu"])
    assert bf16["memory_gb_per_gpu"] < fp32["memory_gb_per_gpu"]


@pytest.mark.parametrize("text,fragment", [
    ("nonsense=1", "unknown trait; valid: backward_transient_blocks, checkpointing"),
    ("tp_comm_overlap", "expected NAME=VALUE"),
    ("tp_comm_overlap=maybe", "true or false"),
    ("zero_stages=0,5", "each of 0, 1, 2, 3"),
    ("pp_schedules=", "each of gpipe"),
    ("selective_policy=all", "one of modules, op"),
    ("grad_reduce_bytes=two", "is a number"),
    ("elementwise_traffic=-1", "must not be negative"),
    ("kernel_efficiency=0.5", "calibrate --out"),
])
def test_bad_traits_are_refused_with_what_is_valid(text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        parse_trait(text)


def test_the_cli_refuses_a_bad_trait_before_pricing(capsys):
    argv = ["estimate", "--model", "llama3.1-8b", "--hardware", "h100-80g", "--gpus", "8",
            "--trait", "zero_stages=9"]
    assert main(argv) == 2
    assert "zero_stages" in capsys.readouterr().err


def test_trait_arguments_round_trip():
    changed = apply_traits(MEGATRON_CORE_2024, ["tp_comm_overlap=false", "zero_stages=0,1,2",
                                                "elementwise_traffic=3.5"])
    texts = trait_arguments(changed, MEGATRON_CORE_2024)
    assert sorted(texts) == ["elementwise_traffic=3.5", "tp_comm_overlap=false",
                             "zero_stages=0,1,2"]
    assert apply_traits(MEGATRON_CORE_2024, texts) == changed


def test_plan_takes_traits_and_says_so(capsys):
    argv = ["plan", "--model", "llama3.1-8b", "--hardware", "h100-80g", "--gpus", "16",
            "--stack", "megatron-core-2024", "--top", "1", "--trait", "tp_comm_overlap=false"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("stack megatron-core-2024 with tp_comm_overlap=false")
    assert _estimate(argv)["traits"] == {"tp_comm_overlap": False}
