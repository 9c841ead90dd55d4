"""The pipeline energy schedule: slack from the dependency graph, clocks within it."""

import pytest

from meshtrain.config import ConfigError
from meshtrain.parallel.pipeline.schedules import build_schedule
from meshtrain.parallel.pipeline.simulator import StageTimes, simulate
from meshtrain.planner.energy.schedule import (
    PowerCurve,
    action_graph,
    energy_schedule,
    power_curve,
)
from meshtrain.planner.hardware.profile import HardwareProfile
from meshtrain.planner.tables.profiles import PROFILES

H100 = PowerCurve(tdp_w=700.0, max_clock_mhz=1980.0, min_clock_mhz=990.0, step_mhz=15.0,
                  static_fraction=0.3)


def _durations(result) -> dict:
    """Per (rank, action) the scheduled compute time, for the simulator."""
    return {(r, a): e - s for r, a, s, e in result.events() if a.kind.is_compute}


def _critical_by_perturbation(schedule, times, delta=1e-3) -> set:
    """Actions whose lengthening lengthens the simulated step: found with the simulator alone."""
    base = simulate(schedule, times)
    critical = set()
    for rank, act, start, end in base.compute_events():
        longer = simulate(schedule, times, {(rank, act): end - start + delta})
        if longer.makespan > base.makespan + delta / 2:
            critical.add((rank, act))
    return critical


def test_power_curve_by_hand():
    # static 210 W; at half clock 210 + 490 / 8; at 2/3 clock 210 + 490 * 8 / 27
    assert H100.busy_power(1980) == pytest.approx(700.0)
    assert H100.busy_power(990) == pytest.approx(271.25)
    assert H100.busy_power(1320) == pytest.approx(355.185, abs=1e-3)
    assert H100.lowest_clock_for(1.2, 0) == 1650  # 1980 / 1.2, a 15 MHz step
    assert H100.lowest_clock_for(1.19, 0) == 1665  # 1663.9 rounds up to the next step
    assert H100.lowest_clock_for(5.0, 0) == 990  # never below the minimum clock
    assert H100.lowest_clock_for(1.5, 1500) == 1500  # nor below the floor
    assert H100.lowest_clock_for(0.9, 0) == 1980
    assert power_curve(PROFILES["h100-80g"]) == H100


def test_profile_without_clocks_is_refused():
    cpu = HardwareProfile("cpu", 1, 1, 1, 1, 1, 1, 1, 1, 1, power_w=10)
    with pytest.raises(ConfigError, match="no clock/power curve"):
        power_curve(cpu)


def test_graph_times_are_the_simulators():
    schedule = build_schedule("zb-v", 4, 8, 2)
    times = [StageTimes(1, 1.5, 0.5, 0.1 * s) for s in range(schedule.num_stages)]
    graph = action_graph(schedule, times)
    start, end = graph.earliest()
    sim = simulate(schedule, times)
    mine = {(r, a): (s, e) for (r, a), s, e in zip(graph.nodes, start, end, strict=True)}
    assert len(mine) == len(sim.events)
    for rank, act, s, e in sim.events:  # a receive's start is its post time there
        assert mine[(rank, act)][1] == pytest.approx(e)
        if not act.kind.is_recv:
            assert mine[(rank, act)][0] == pytest.approx(s)


def test_1f1b_pp2_two_microbatches_by_hand():
    # rank 0: F0 0-1, F1 1-2, B0 4-6, B1 7-9; rank 1: F0 1-2, B0 2-4, F1 4-5, B1 5-7 (B = 2).
    # Off the critical path: rank 0's F1 (may end by 4: twice as long, 990 MHz) and B0 (may
    # end by 7: 1.5 times, 1320 MHz). Baseline: 12 busy units at 700 W + 6 idle at 210 W.
    schedule = build_schedule("1f1b", 2, 2, early_grad_sends=False)  # the paper's order
    result = energy_schedule(schedule, StageTimes(1, 1, 1), H100, max_slowdown=0.0)
    assert result.baseline_makespan == pytest.approx(9.0)
    assert result.makespan == pytest.approx(9.0)
    assert result.baseline_energy_j == pytest.approx(12 * 700 + 6 * 210)
    slowed = {(r, str(a)): c for (r, a), c in zip(result.graph.nodes, result.clocks, strict=True)
              if c < 1980}
    assert slowed == {(0, "F1@s0"): 990, (0, "B0@s0"): 1320}
    # 700 (F0) + 2 * 271.25 (F1) + 3 * 355.185 (B0) + 1400 (B1) + 1 idle unit on rank 0;
    # rank 1 unchanged: 4200 + 3 idle units.
    expected = 700 + 542.5 + 3 * (210 + 490 * 8 / 27) + 1400 + 210 + 4200 + 630
    assert result.energy_j == pytest.approx(expected)
    assert result.saving == pytest.approx(1 - expected / 9660)


@pytest.mark.parametrize("name,pp,m", [("1f1b", 1, 6), ("zb-h1", 1, 4), ("1f1b", 4, 1)])
def test_no_slack_no_saving(name, pp, m):
    # No pipeline (pp 1: no bubble at all), or one micro-batch (every action on one chain:
    # the bubble is idle time no action can use), balanced: nothing may be slowed.
    # (1F1B in the paper's order: with early gradient sends the split W's of ranks > 0 are off
    # the chain, test_early_gradient_sends_leave_slack_to_the_w_passes)
    result = energy_schedule(build_schedule(name, pp, m, early_grad_sends=False),
                             StageTimes(1, 1, 1), H100, 0.01)
    assert result.saving == 0.0
    assert result.makespan == result.baseline_makespan
    assert all(c == 1980 for c in result.clocks)


def test_early_gradient_sends_leave_slack_to_the_w_passes():
    """One micro-batch through 4 stages: each rank > 0 sends its input gradient before its W,
    so the W runs beside the earlier ranks' backwards, at a lower clock, at no cost in time."""
    result = energy_schedule(build_schedule("1f1b", 4, 1), StageTimes(1, 1, 1), H100, 0.01)
    assert result.makespan == pytest.approx(result.baseline_makespan)
    slowed = {str(a) for (_, a), c in zip(result.graph.nodes, result.clocks, strict=True)
              if c < 1980}
    assert slowed == {"W0@s1", "W0@s2", "W0@s3"} and result.saving > 0


def test_imbalanced_1f1b_saves_without_slowing_the_critical_path():
    schedule = build_schedule("1f1b", 8, 16)
    times = [StageTimes(1, 1, 1)] * 8
    times[3] = StageTimes(1.2, 1.2, 1.2)  # one stage 20 % slower
    result = energy_schedule(schedule, times, H100, max_slowdown=0.01)
    resim = simulate(schedule, times, _durations(result))
    base = simulate(schedule, times)
    assert resim.makespan <= base.makespan * 1.01 + 1e-9
    assert resim.makespan == pytest.approx(result.makespan)
    assert 0.05 < result.saving < 0.30  # Perseus: up to ~30 %
    critical = _critical_by_perturbation(schedule, times)
    assert critical  # stage 3's actions at least
    assert all(r == 3 for r, a in critical if a.kind.is_compute and a.microbatch in (5, 6, 7))
    scheduled = {(r, a): e - s for r, a, s, e in resim.compute_events()}
    original = {(r, a): e - s for r, a, s, e in base.compute_events()}
    for key in critical:
        assert scheduled[key] == pytest.approx(original[key])
    assert any(scheduled[k] > original[k] + 1e-9 for k in original)


def test_max_slowdown_zero_keeps_the_step():
    schedule = build_schedule("zb-h1", 4, 8)
    times = [StageTimes(1, 1, 1)] * 4
    times[1] = StageTimes(1.3, 1.3, 1.3)
    result = energy_schedule(schedule, times, H100, max_slowdown=0.0)
    assert result.makespan == pytest.approx(result.baseline_makespan)
    assert result.saving > 0
    with pytest.raises(ConfigError):
        energy_schedule(schedule, times, H100, max_slowdown=-0.1)


@pytest.mark.parametrize("pp,m", [(4, 8), (8, 32)])
def test_balanced_zero_bubble_saves_nothing_in_the_steady_state(pp, m):
    # zb-v at F = B = W on equal stages is a parallelogram: every rank busy without a gap from
    # its first action to its last. When steps follow one another without a flush, the next
    # step's warm-up fills the drain, so there is no slack and nothing may be slowed.
    schedule = build_schedule("zb-v", pp, m, 2)
    result = energy_schedule(schedule, StageTimes(1, 1, 1), H100, 0.01, steady_state=True)
    assert result.saving == 0.0
    assert all(c == 1980 for c in result.clocks)


def test_flushed_zero_bubble_slows_only_the_drain():
    # The same schedule with a flush (meshtrain's steps end with the optimizer step): the only
    # slack is the parallelogram's edge, so the ranks that finish before the step's end are the
    # only ones slowed, and the saving shrinks as micro-batches make the edge a smaller share.
    savings = []
    for m in (8, 32):
        schedule = build_schedule("zb-v", 4, m, 2)
        result = energy_schedule(schedule, StageTimes(1, 1, 1), H100, 0.01)
        base = simulate(schedule, StageTimes(1, 1, 1))
        ends = {}
        for r, _, _, e in base.compute_events():
            ends[r] = max(ends.get(r, 0.0), e)
        slowed = {r for (r, a), c in zip(result.graph.nodes, result.clocks, strict=True)
                  if c < 1980}
        assert slowed and all(ends[r] < base.makespan - 0.5 for r in slowed)
        savings.append(result.saving)
    assert 0 < savings[1] < savings[0]


def test_steady_state_keeps_slack_inside_a_rank():
    # Steady state removes only the fill/drain edges: an imbalanced zb-v (ranks waiting for a
    # slow stage inside their span) and zb-h1's own bubbles still leave actions to slow.
    schedule = build_schedule("zb-v", 4, 8, 2)
    times = [StageTimes(1, 1, 1)] * 8
    times[2] = StageTimes(1.2, 1.2, 1.2)
    assert energy_schedule(schedule, times, H100, 0.01, steady_state=True).saving > 0.01
    zb_h1 = build_schedule("zb-h1", 4, 8)
    assert energy_schedule(zb_h1, StageTimes(1, 1, 1), H100, 0.01, steady_state=True).saving > 0
