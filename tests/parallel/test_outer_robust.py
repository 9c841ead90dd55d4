"""Robust outer updates on CPU processes: one bad replica group cannot poison the others.

Three replica groups of one process (a tiny model, H = 4, 16 steps), group 1 poisoned from
inner step 8 on by the test-only ``poison_outer`` fault (:mod:`meshtrain.faults`): every
pseudo-gradient it sends is NaN, or 1000 × its own. With the default aggregate (``clipped-mean``
at 3 groups), and with 2 streaming fragments, int8 exchange, the coordinate-wise median and an
overlapped exchange, the final loss stays within 5 % of the clean run's, every round from step
8 on lists group 1 in ``outer_rejected``, and the groups end with the same finite weights. The
same faults under an explicit ``outer_aggregate = "mean"`` (the plain mean, no screening) hurt
visibly: the 1000 × group ruins the model, and the NaN group makes every outer update from step 8
on non-finite, so each is skipped (never applied: the state stays finite) and the run stops
improving; so the fault does bite. With all three groups
NaN every outer update from step 8 on is skipped and the state stays finite.
All cases run in one launch of 3 workers. Last, 3 fault-tolerant groups (jobs of their own,
through torchft) with the ``median`` leave the poisoned group out the same way.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import tiny_config

STEPS, H, FROM = 16, 4, 8
BASE = ("parallel.replicas=3", f"parallel.sync_every={H}", f"train.steps={STEPS}",
        "train.global_batch=6")
NAN = f"poison_outer:replica=1:step={FROM}:mode=nan"
SCALE = f"poison_outer:replica=1:step={FROM}:mode=scale:factor=1000"
ALL_NAN = ",".join(f"poison_outer:replica={g}:step={FROM}:mode=nan" for g in range(3))
CASES = {  # name: (overrides, fault)
    "clean": ((), ""),
    "nan": ((), NAN),
    "scale": ((), SCALE),
    "mean, scale": (("parallel.outer_aggregate=mean",), SCALE),
    "mean, nan": (("parallel.outer_aggregate=mean",), NAN),
    "2 fragments": (("parallel.sync_fragments=2",), SCALE),
    "int8": (("parallel.outer_grad_dtype=int8",), NAN),
    "median": (("parallel.outer_aggregate=median",), SCALE),
    "overlap": (("parallel.sync_overlap=1",), SCALE),
    "all nan": ((), ALL_NAN),
}


def _train_cases(cases: list[tuple[dict, str]], steps: int) -> list[tuple[list, list, bool]]:
    """Train each (config, fault) in turn; per case rank 0's records, this rank's master
    checksums, and whether its masters, outer start weights and momentum are all finite."""
    from meshtrain import faults
    from meshtrain.config import config_from_dict
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    results = []
    for config_dict, spec in cases:
        os.environ[faults.ENV_VAR] = spec
        faults.reset()
        try:
            config = config_from_dict(config_dict)
            mesh = build_mesh(config)
            trainer = Trainer(config, mesh)
            records = [trainer.train_step() for _ in range(steps)]
        finally:
            del os.environ[faults.ENV_VAR]
            faults.reset()
        state = [s.master for s in trainer.optimizer.shards]
        state += trainer.outer.start + trainer.outer.momentum_buf
        finite = all(bool(torch.isfinite(t).all()) for t in state)
        sums = [float(s.master.double().sum()) for s in trainer.optimizer.shards]
        results.append((records if mesh.is_logging_rank else [], sums, finite))
    return results


def _sync_steps(overrides: tuple[str, ...]) -> list[int]:
    if "parallel.sync_fragments=2" in overrides:
        return list(range(2, STEPS + 1, 2))  # fragment 0 at s mod 4 = 2, fragment 1 at 0
    return list(range(H, STEPS + 1, H))


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list, list, bool]]:
    configs = [(tiny_config(*BASE, *overrides, nproc=3).to_dict(), fault)
               for overrides, fault in CASES.values()]
    per_rank = run_distributed(3, _train_cases, configs, STEPS)
    by_name = {}
    for index, name in enumerate(CASES):
        records = per_rank[0][index][0]
        sums = [per_rank[rank][index][1] for rank in range(3)]
        finite = all(per_rank[rank][index][2] for rank in range(3))
        by_name[name] = (records, sums, finite)
    return by_name


def _final_loss(records: list[dict]) -> float:
    return records[-1]["loss"]


@pytest.mark.parametrize("name", ["clean", "nan", "scale", "2 fragments", "int8", "median",
                                  "overlap"])
def test_a_poisoned_group_is_left_out(runs, name):
    records, sums, finite = runs[name]
    overrides, fault = CASES[name]
    syncs = _sync_steps(overrides)
    for record in records:
        step = record["step"]
        if step not in syncs:
            assert "outer_rejected" not in record, step
        elif fault and step >= FROM:
            assert record["outer_rejected"] == [1], (step, record)
        else:
            assert record["outer_rejected"] == [], (step, record)
    assert finite and sums[0] == sums[1] == sums[2]  # every group ends with the same weights
    clean = _final_loss(runs["clean"][0])
    print(f"{name}: final loss {_final_loss(records):.4f} (clean {clean:.4f})")
    assert _final_loss(records) == pytest.approx(clean, rel=0.05)
    assert _final_loss(records) < records[0]["loss"] - 0.3  # it trains


@pytest.mark.parametrize("fault", ["scale", "nan"])
def test_the_fault_bites_under_a_plain_mean(runs, fault):
    """The poisoned group in a plain mean: the 1000 × one ruins the loss; the NaN one makes
    every outer update non-finite, so none is applied (the state stays finite) and the run falls
    clearly behind the clean one."""
    records, sums, finite = runs[f"mean, {fault}"]
    assert all(r["outer_rejected"] == [] for r in records if "outer_rejected" in r)
    clean = _final_loss(runs["clean"][0])
    loss = _final_loss(records)
    print(f"plain mean, {fault}: final loss {loss:.4f} (clean {clean:.4f})")
    if fault == "scale":
        assert not math.isfinite(loss) or loss > 1.5 * clean
    else:
        assert finite and sums[0] == sums[1] == sums[2]
        assert loss > 1.05 * clean  # beyond the 5 % the screened runs stay within


def test_every_group_nan_skips_the_outer_updates(runs):
    """No group kept: each round from step 8 on is skipped (masters back at its start, the
    outer state untouched), so the state stays finite and the groups end equal."""
    records, sums, finite = runs["all nan"]
    rejected = {r["step"]: r["outer_rejected"] for r in records if "outer_rejected" in r}
    assert rejected == {4: [], 8: [0, 1, 2], 12: [0, 1, 2], 16: [0, 1, 2]}
    assert finite and sums[0] == sums[1] == sums[2]
    assert all(math.isfinite(r["loss"]) for r in records)


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                    reason="torchft is not installed (pip install -e '.[ft]')")
@pytest.mark.timeout(300)
def test_fault_tolerant_groups_leave_the_poisoned_one_out(tmp_path):
    """The same fault with 3 groups as jobs of their own (torchft, a lighthouse) and the
    ``median``, which all-reduces a groups × n buffer there: every group's rounds from step 8 on
    list group 1, and all three end with bitwise identical final weights."""
    from tests.integration.test_replica_faults import _final, _group, _lighthouse, _metrics

    extra = (*BASE, "parallel.outer_aggregate=median")
    procs = []
    try:
        lighthouse, address = _lighthouse(tmp_path)
        procs.append(lighthouse)
        groups = [_group(tmp_path, g, address, f"group{g}.log", fault=SCALE, extra=extra)
                  for g in range(3)]
        procs += groups
        for g, proc in enumerate(groups):
            assert proc.wait(240) == 0, (tmp_path / f"group{g}.log").read_text()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for g in range(3):
        records = _metrics(tmp_path / f"group{g}")
        rejected = {r["step"]: r["outer_rejected"] for r in records if "outer_rejected" in r}
        assert rejected == {4: [], 8: [1], 12: [1], 16: [1]}, (g, rejected)
        assert all(math.isfinite(r["loss"]) for r in records)
    assert "replica group 1 left out" in (tmp_path / "group0.log").read_text()
    assert _final(tmp_path / "group0") == _final(tmp_path / "group1") == _final(
        tmp_path / "group2")
