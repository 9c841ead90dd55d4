"""plan --objective and the training budget (--tokens, --deadline-hours)."""

import pytest

from meshtrain.config import ConfigError
from meshtrain.planner.cost.workload import Workload
from meshtrain.planner.search.objective import (
    budget_plan,
    format_budget_plan,
    gpu_counts,
    objective_value,
    rank_rows,
    run_totals,
)
from meshtrain.planner.tables.presets import preset_config
from meshtrain.planner.tables.profiles import PROFILES

ROW = {"tokens_per_s": 1e6, "kwh_per_1b_tokens": 100.0, "cost_per_1b_tokens": 10.0,
       "co2_kg_per_1b_tokens": 40.0, "dp": 2, "tp": 4, "pp": 1, "cp": 1}


def test_run_totals_by_hand():
    # 3.6e12 tokens at 1e6 tokens/s = 1000 h; 3600 x the per-1B figures; 8 GPUs x 1000 h x 2
    totals = run_totals(ROW, 3.6e12, 8, gpu_hour_price=2.0)
    assert totals == pytest.approx({"gpus": 8, "hours": 1000.0, "kwh": 360_000.0,
                                    "cost": 36_000.0 + 16_000.0, "co2_t": 144.0})


def test_objective_values_and_ranking():
    assert objective_value(ROW, "time") == pytest.approx(1000.0)  # s per 1e9 tokens
    assert objective_value(ROW, "energy") == 100.0
    assert objective_value(ROW, "carbon") == 40.0
    # 8 GPUs x 1000 s = 2.222 GPU hours at 9 per hour = 20, plus 10 of electricity
    assert objective_value(ROW, "cost", gpu_hour_price=9.0) == pytest.approx(30.0)
    frugal = {**ROW, "tokens_per_s": 0.9e6, "kwh_per_1b_tokens": 80.0}
    assert rank_rows([ROW, frugal], "energy")[0] is frugal
    assert rank_rows([ROW, frugal], "time")[0] is ROW
    with pytest.raises(ConfigError):
        objective_value(ROW, "speed")


def test_gpu_counts_are_powers_of_two_in_whole_nodes():
    assert gpu_counts(64, 8) == [1, 2, 4, 8, 16, 32, 64]
    assert gpu_counts(24, 8) == [1, 2, 4, 8, 16, 24]


@pytest.fixture(scope="module")
def small():
    config = preset_config("llama3.2-1b")
    config.train.global_batch = 64
    config.train.seq_len = 2048
    return Workload.from_config(config)


def test_energy_plan_is_never_above_the_time_optimal(small):
    h100 = PROFILES["h100-80g"]
    fastest = budget_plan(small, h100, 32, 8, 1e10, 1e6, "time")["chosen"]
    answer = budget_plan(small, h100, 32, 8, 1e10, 1e6, "energy")
    assert answer["time_optimal"]["hours"] == pytest.approx(fastest["hours"])
    assert answer["chosen"]["kwh"] <= answer["time_optimal"]["kwh"]
    assert answer["chosen"]["kwh"] == min(c["kwh"] for c in answer["by_gpu_count"])
    text = format_budget_plan(answer, "small")
    assert "less energy" in text and "time-optimal" in text


def test_missed_deadline_says_what_would_do(small):
    answer = budget_plan(small, PROFILES["h100-80g"], 16, 8, 1e13, 1.0, "energy")
    assert answer["chosen"] is None
    fastest = min(answer["by_gpu_count"], key=lambda c: c["hours"])
    assert f"takes {fastest['hours']:,.0f} h" in answer["message"]
    assert "deadline of at least" in answer["message"] and "GPUs" in answer["message"]
