"""The validation set's train / test split: fitting reads train rows only, the fitted constants
are what the train rows give, every published layout fits (but the one docs/planner.md names
as judged not to fit: an expected failure), and docs/planner.md quotes the numbers the code
computes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from meshtrain.planner.tables import fitting
from meshtrain.planner.tables.fitting import NotATrainRow, fit_groups, refit, require_train
from meshtrain.planner.tables.profiles import (
    ALLOCATOR_RESERVE,
    OVERLAP_CONTENTION,
    PROFILES,
    PUBLISHED_MFU_CAPS,
)
from meshtrain.planner.tables.published import (
    evaluate,
    headline,
    published_rows,
    summary,
    table_lines,
)
from meshtrain.planner.tables.stacks import (
    MEGATRON_2021_A100,
    MEGATRON_CORE_2024_H100,
    MEGATRON_CORE_2025_H100,
    MEGATRON_DEEPSPEED_A100,
    TORCHTITAN_2024_A100,
    TORCHTITAN_2025_H100,
)

ROWS = published_rows()
RESULTS = [evaluate(row) for row in ROWS]
TEST_ROWS = [r for r in ROWS if r.split == "test"]
TRAIN_ROWS = [r for r in ROWS if r.split == "train"]

WRITTEN = {"megatron-2021 a100": MEGATRON_2021_A100.gemm,
           "torchtitan-2024 a100": TORCHTITAN_2024_A100.gemm,
           "megatron-deepspeed a100": MEGATRON_DEEPSPEED_A100.gemm,
           "megatron-core-2024 h100": MEGATRON_CORE_2024_H100.gemm,
           "megatron-core-2024 h100 fp8": MEGATRON_CORE_2024_H100.fp8_gemm,
           "megatron-core-2025 h100 experts": MEGATRON_CORE_2025_H100.expert_overhead_ns,
           "torchtitan-2025 h100": TORCHTITAN_2025_H100.gemm,
           "allocator reserve": ALLOCATOR_RESERVE,
           "overlap contention": OVERLAP_CONTENTION,
           "mfu cap a100": PUBLISHED_MFU_CAPS["a100"][0],
           "mfu cap h100": PUBLISHED_MFU_CAPS["h100"][0]}
"""Every fitted constant the code uses, by its fit_groups name."""


def test_every_row_is_train_or_test_and_names_its_source():
    assert {r.split for r in ROWS} == {"train", "test"}
    assert len({r.name for r in ROWS}) == len(ROWS)
    for r in ROWS:
        assert r.source and r.stack and r.profile in PROFILES, r.name
        assert bool(r.fits) == (r.split == "train"), r.name
    assert len(TEST_ROWS) > 2 * len(TRAIN_ROWS)


@pytest.mark.parametrize("routine", [fitting.fit_gemm_efficiency, fitting.fit_allocator_reserve,
                                     fitting.fit_mfu_cap, require_train])
def test_fitting_routines_refuse_any_test_row(routine):
    memory = [r for r in TEST_ROWS if r.metric == "memory_gb_per_gpu"][:1]
    rate = [r for r in TEST_ROWS if r.metric != "memory_gb_per_gpu"][:1]
    train = [r for r in TRAIN_ROWS if r.fits == "megatron-2021 a100"]
    for rows in (memory, rate, train + rate, []):
        with pytest.raises(NotATrainRow):
            routine(rows)


def test_the_contention_fit_refuses_any_test_row_and_finds_the_smallest_spread():
    groups = fitting.speed_groups(ROWS)
    test = {"megatron-core-2024 h100": [r for r in TEST_ROWS if r.stack == "megatron-core-2024"
                                        and r.metric != "memory_gb_per_gpu"][:2]}
    with pytest.raises(NotATrainRow):
        fitting.fit_overlap_contention(test)
    # The written value is where the train rows' spread is least: a step either way widens it.
    spread = {c: fitting.contention_spread(groups, c)
              for c in (0.0, OVERLAP_CONTENTION - 0.1, OVERLAP_CONTENTION,
                        OVERLAP_CONTENTION + 0.1, 1.0)}
    assert spread[OVERLAP_CONTENTION] == min(spread.values())
    assert spread[0.0] > 1.2 * spread[OVERLAP_CONTENTION]


def test_fit_groups_hold_train_rows_only():
    groups = fit_groups(ROWS)
    assert set(groups) == set(WRITTEN)
    for name, rows in groups.items():
        assert rows and all(r.split == "train" for r in rows), name


def test_the_written_constants_are_what_the_train_rows_give():
    fitted = refit(ROWS)
    # Written to 3 decimals; the overhead in ns to 0.1; the contention to 2 (the train rows'
    # spread is flat around it: 1.71-1.73 % RMS from 0.4 to 0.55).
    tolerances = {"overlap contention": 0.005}
    for name, value in WRITTEN.items():
        tolerance = tolerances.get(name, 0.1 if name.endswith(" experts") else 0.0015)
        assert fitted[name] == pytest.approx(value, abs=tolerance), name


def test_test_rows_never_reach_a_constant():
    # Double every test row's published figure: no fitted constant may move.
    doubled = [dataclasses.replace(r, published=2 * r.published) if r.split == "test" else r
               for r in ROWS]
    assert refit(doubled) == refit(ROWS)


@pytest.mark.parametrize("result", RESULTS, ids=[r["name"] for r in RESULTS])
def test_no_published_layout_is_judged_not_to_fit(result):
    assert result["fits"], (result["name"], round(result["memory_gb_per_gpu"], 1))


MEMORY_PRICED_LOW = {"Llama 3.1 70B FSDP 32 TP 8 Float8 memory"}
"""Published memory rows the planner prices more than 15 % low (docs/planner.md, Known limits):
torchtitan's 2D run of Llama 3.1 70B (with AsyncTP it is 14.9 % low)."""


def test_test_rows_meet_the_accuracy_target():
    mean, _ = summary(RESULTS, "test")
    assert mean <= 0.10
    memory_mean, _ = summary(RESULTS, "test", "memory")
    assert memory_mean <= 0.10
    rest = [r for r in RESULTS if r["name"] not in MEMORY_PRICED_LOW]
    _, memory_worst = summary(rest, "test", "memory")
    assert memory_worst <= 0.15
    # The rows listed as priced low still are (fixing one means taking it off the list).
    low = {r["name"]: r["error"] for r in RESULTS if r["name"] in MEMORY_PRICED_LOW}
    assert len(low) == len(MEMORY_PRICED_LOW) and all(e < -0.15 for e in low.values()), low


def _doc() -> str:
    return (Path(__file__).parents[3] / "docs" / "planner.md").read_text()


def test_docs_per_row_table_and_headline_are_what_the_code_computes():
    doc = _doc()
    lines = doc.splitlines()
    table = table_lines(RESULTS)
    start = lines.index(table[0])
    assert lines[start:start + len(table)] == table
    assert headline(RESULTS) in " ".join(doc.split())


def test_readme_quotes_the_current_test_accuracy():
    readme = " ".join((Path(__file__).parents[3] / "README.md").read_text().split())
    mean, _ = summary(RESULTS, "test")
    assert f"the throughput error is {100 * mean:.1f} % on average" in readme
