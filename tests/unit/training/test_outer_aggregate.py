"""Robust outer updates (:mod:`meshtrain.training.diloco.robust`) in one process.

Hand-computed cases for the screening and for each aggregate; a group with NaN and one 1000 ×
larger than the others are left out; the 8-bit path's reducer ignores a NaN group's bytes; the
fault-tolerant path (torchft's sum / participants all-reduce, played by threads) gives every
group the same result; an outer update that is not finite is skipped without touching the
outer state; and the ``poison_outer`` test fault. Multi-process runs:
tests/parallel/test_outer_robust.py.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

from meshtrain import faults
from meshtrain.training.diloco import robust
from meshtrain.training.diloco.quantized_reduce import BLOCK, quantize, received_rows

NAN = math.nan


def _verdict(norms, kept, clip=1.0):
    reasons = {g: "left out" for g, k in enumerate(kept) if not k}
    return robust.Verdict(tuple(norms), tuple(kept), reasons, robust.median(norms), clip)


def test_auto_aggregate_and_median():
    assert robust.resolve_aggregate("", 2) == "mean"
    assert robust.resolve_aggregate("", 3) == "clipped-mean"
    assert robust.resolve_aggregate("median", 2) == "median"
    with pytest.raises(ValueError, match="valid: clipped-mean"):
        robust.resolve_aggregate("mode", 3)
    assert robust.median([3.0, 1.0, 2.0]) == 2.0
    assert robust.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert math.isnan(robust.median([]))


def test_screening_leaves_out_nonfinite_and_outsized_groups():
    # norms 1, 1.1, 1000, NaN, inf: median of the finite ones 1.1; 1000 > 10 × 1.1.
    verdict = robust.screen([1.0, 1.21, 1e6, NAN, math.inf], 10.0)
    assert verdict.kept == (True, True, False, False, False)
    assert verdict.rejected == [2, 3, 4] and verdict.count == 2
    assert verdict.median == pytest.approx(1.1)
    assert "not finite" in verdict.reasons[3] and "not finite" in verdict.reasons[4]
    assert "1000 is over 10 × the median 1.1" in verdict.reasons[2]
    assert verdict.clip == pytest.approx(1.05)  # the median of the kept norms 1 and 1.1
    # exactly ratio × median is kept ("exceeds" is strict); an absent group is not "rejected"
    edge = robust.screen([1.0, 1.0, 100.0, 0.0], 10.0, present=[True, True, True, False])
    assert edge.kept == (True, True, True, False) and edge.rejected == []
    # two groups: the median is their mean, so only a non-finite one can be left out
    assert robust.screen([1.0, 1e12], 10.0).rejected == []
    assert robust.screen([1.0, NAN], 10.0).kept == (True, False)


ROWS = torch.tensor([[1.0, 0.0, 3.0],
                     [2.0, 0.0, 4.0],
                     [3.0, 1.0, -5.0],
                     [4.0, 5.0, 6.0],
                     [100.0, 9.0, 7.0],
                     [NAN, NAN, NAN]])  # group 5 left out
KEPT = (True,) * 5 + (False,)


@pytest.mark.parametrize(("aggregate", "expected"), [
    ("mean", [22.0, 3.0, 3.0]),
    ("median", [3.0, 1.0, 4.0]),
    # without each column's largest and smallest of the 5 kept: (2+3+4)/3, (0+1+5)/3, (3+4+6)/3
    ("trimmed-mean", [3.0, 2.0, 13.0 / 3]),
])
def test_coordinate_aggregates_by_hand(aggregate, expected):
    result = robust.combine(ROWS.clone(), _verdict([1.0] * 6, KEPT), aggregate)
    assert result.tolist() == pytest.approx(expected)


def test_even_median_small_trimmed_and_nothing_kept():
    rows = torch.tensor([[1.0, 8.0], [3.0, 2.0], [NAN, NAN], [5.0, 4.0], [7.0, 6.0]])
    four = _verdict([1.0] * 5, (True, True, False, True, True))
    assert robust.combine(rows, four, "median").tolist() == [4.0, 5.0]  # middle two's mean
    two = _verdict([1.0] * 5, (True, True, False, False, False))
    assert robust.combine(rows, two, "trimmed-mean").tolist() == [2.0, 5.0]  # < 3: the mean
    none = _verdict([1.0] * 5, (False,) * 5)
    assert torch.isnan(robust.combine(rows, none, "mean")).all()


def test_clipped_mean_by_hand_and_its_one_all_reduce():
    """Norms 5, 1, 10 (and a NaN group): each clipped to the kept median 5, so the third is
    halved: ([3, 4] + [0, 1] + [3, 4]) / 3. Summing each group's :func:`contribution` and
    dividing by the kept count (what one all-reduce does) gives the same."""
    rows = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0], [NAN, NAN]])
    verdict = robust.screen([float(r.square().sum()) for r in rows], 10.0)
    assert verdict.kept == (True, True, True, False) and verdict.clip == 5.0
    assert robust.combine(rows.clone(), verdict, "clipped-mean").tolist() == [2.0, 3.0]
    for aggregate in robust.SUM_AGGREGATES:
        summed = sum(robust.contribution(rows[g].clone(), verdict, g, aggregate)
                     for g in range(4)) / verdict.count
        assert torch.equal(summed, robust.combine(rows.clone(), verdict, aggregate))
    assert torch.equal(robust.contribution(rows[3].clone(), verdict, 3, "mean"), torch.zeros(2))


@pytest.mark.parametrize("aggregate", robust.AGGREGATES)
def test_a_nan_group_and_a_1000x_group_change_nothing(aggregate):
    """Four groups: two alike, one 1000 × larger, one NaN. Every aggregate equals its value
    over the two good groups alone."""
    generator = torch.Generator().manual_seed(0)
    good = torch.randn(2, 64, generator=generator)
    rows = torch.cat([good, 1000 * torch.randn(1, 64, generator=generator),
                      torch.full((1, 64), NAN)])
    verdict = robust.screen([robust.squared_norm(r) for r in rows], 10.0)
    assert verdict.rejected == [2, 3]
    result = robust.combine(rows.clone(), verdict, aggregate)
    clean = robust.combine(good.clone(), robust.screen(
        [robust.squared_norm(r) for r in good], 10.0), aggregate)
    torch.testing.assert_close(result, clean, rtol=0, atol=0)
    assert torch.isfinite(result).all()


@pytest.mark.parametrize("aggregate", ["mean", "median"])
def test_int8_reducer_ignores_a_nan_groups_bytes(aggregate):
    """Rank j of the 8-bit exchange dequantizes the chunks it received (row r from group r)
    and reduces them: a NaN group's bytes (garbage after quantizing) never reach the result,
    which is within int8 rounding of the fp32 aggregate of the good groups."""
    generator = torch.Generator().manual_seed(1)
    chunks = torch.randn(4, 2 * BLOCK, generator=generator)
    chunks[2] = NAN
    pieces = [quantize(chunk.clone(), "int8") for chunk in chunks]
    data = torch.cat([p[0] for p in pieces])
    scales = torch.cat([p[1] for p in pieces])
    rows = received_rows(data, scales, 4, "int8")
    verdict = robust.screen([robust.squared_norm(c) for c in chunks], 10.0)
    assert verdict.rejected == [2]
    got = robust.combine(rows, verdict, aggregate)
    exact = robust.combine(chunks.clone(), verdict, aggregate)
    assert torch.isfinite(got).all()
    step = chunks[[0, 1, 3]].abs().amax() / 127
    assert (got - exact).abs().max() <= step


class ThreadQuorum:
    """torchft's all-reduce for groups played by threads: the sum over the callers, divided by
    their number (``num_participants``), in place."""

    def __init__(self, participants: int):
        self.participants = participants
        self.barrier = threading.Barrier(participants)
        self.lock = threading.Lock()
        self.total = None

    def allreduce_mean(self, tensor: torch.Tensor) -> None:
        with self.lock:
            self.total = tensor.clone() if self.total is None else self.total + tensor
        self.barrier.wait()
        tensor.copy_(self.total / self.participants)
        if self.barrier.wait() == 0:
            self.total = None
        self.barrier.wait()


@pytest.mark.parametrize("aggregate", robust.AGGREGATES)
def test_fault_tolerant_rounds_agree_and_leave_the_bad_group_out(aggregate):
    """5 groups declared, 4 in the quorum (group 4 absent): group 2 sends 1000 × its update,
    group 3 NaN. Every present group gets the same aggregate, equal (up to the sum /
    participants rounding) to that of groups 0 and 1 alone; an empty fragment stays empty."""
    generator = torch.Generator().manual_seed(2)
    flats = torch.randn(4, 300, generator=generator)
    flats[2] *= 1000
    flats[3] = NAN
    quorum = ThreadQuorum(4)
    results: dict[int, tuple] = {}

    def run(group: int) -> None:
        results[group] = robust.quorum_aggregate(
            [flats[group].clone(), torch.zeros(0)], group, 5, aggregate, 10.0, torch.float32,
            4, quorum.allreduce_mean, lambda t: None)

    threads = [threading.Thread(target=run, args=(g,)) for g in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3]
    means, verdicts = results[0]
    assert verdicts[0].rejected == [2, 3] and verdicts[0].kept == (True, True, False, False,
                                                                   False)
    assert means[1].numel() == 0 and verdicts[1].rejected == []
    for group in (1, 2, 3):
        assert torch.equal(results[group][0][0], means[0])
    good = flats[:2]
    clean = robust.combine(good.clone(), robust.screen(
        [robust.squared_norm(r) for r in good], 10.0), aggregate)
    torch.testing.assert_close(means[0], clean, rtol=1e-5, atol=1e-6)


def test_a_nonfinite_outer_update_is_skipped():
    """One process (one group): a NaN outer gradient puts the masters back at the round's
    start and leaves start, momentum and parameters finite; the next round steps normally."""
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.diloco.outer import OuterOptimizer
    from meshtrain.training.trainer import Trainer
    from tests.helpers import tiny_config

    trainer = Trainer(tiny_config(), ParallelMesh(), with_data=False)
    outer = OuterOptimizer(trainer.optimizer, trainer.mesh, 1, lr=0.7, momentum=0.9)
    master = trainer.optimizer.shards[0].master
    start = outer.start[0].clone()
    outer.momentum_buf[0].fill_(0.25)
    with torch.no_grad():
        master.sub_(0.01)
    outer.apply([0], [torch.full_like(master, NAN)])
    assert torch.equal(master, start) and torch.equal(outer.start[0], start)
    assert bool((outer.momentum_buf[0] == 0.25).all()) and outer.rounds == 1
    params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    assert torch.isfinite(params).all()
    with torch.no_grad():
        master.sub_(0.01)
    outer.sync()
    assert torch.isfinite(master).all() and not torch.equal(master, start)
    assert outer.rejected == [] and outer.aggregate == "mean"


def test_poison_outer_fault(monkeypatch):
    assert faults.parse("poison_outer:replica=1:step=8:mode=scale:factor=1000") == (
        faults.Fault("poison_outer", 8, replica=1, mode="scale", factor=1000.0),)
    for bad in ("poison_outer:step=8:mode=nan", "poison_outer:replica=1:step=8:mode=zero",
                "poison_outer:replica=1:step=8:mode=noise"):
        with pytest.raises(ValueError, match="needs replica=R"):
            faults.parse(bad)
    monkeypatch.setenv(faults.ENV_VAR, "poison_outer:replica=1:step=8:mode=noise:factor=3,"
                       "poison_outer:replica=2:step=4:mode=nan")
    faults.reset()
    try:
        values = torch.arange(1.0, 9.0)
        assert faults.poison_outer(values, 7, 1) is values  # before its step
        assert faults.poison_outer(values, 12, 0) is values  # another group
        noisy = faults.poison_outer(values, 8, 1)
        assert float(noisy.norm()) == pytest.approx(3 * float(values.norm()), rel=1e-5)
        assert torch.isnan(faults.poison_outer(values, 4, 2)).all()
    finally:
        monkeypatch.delenv(faults.ENV_VAR)
        faults.reset()
