"""Streaming DiLoCo's overlapped exchange (``parallel.sync_overlap = τ``) on CPU processes.

The check that does not restate the code: with outer lr 1, no outer momentum and
``train.outer_mix = 0``, the outer step sets a fragment to the mean of the groups' weights at the
round's end. With τ = 2 that mean is taken from the weights after step s and lands after step
s + 2, discarding the two steps trained meanwhile: the weights after step s + 2 must equal the
average of both groups' weights after step s (read from every rank), while at step s + 1 the
groups still differ. Tolerance 1e-6 absolute: the outer step computes start − (start − mean)
in fp32 on weights of size ~0.1 (one rounding each way, ~1e-8), far below the ~1e-3 a step moves.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed
from tests.helpers import tiny_config

AVERAGE = ("parallel.replicas=2", "parallel.sync_every=3", "parallel.sync_overlap=2",
           "train.outer_lr=1", "train.outer_momentum=0", "train.outer_mix=0")


def _masters_per_step(config_dict: dict, steps: int) -> tuple[list[dict], list[torch.Tensor]]:
    """Train ``steps`` steps; return rank 0's records and this rank's masters after each."""
    from meshtrain.config import config_from_dict
    from meshtrain.run.worker import build_mesh
    from meshtrain.training.trainer import Trainer

    config = config_from_dict(config_dict)
    mesh = build_mesh(config)
    trainer = Trainer(config, mesh)
    records, masters = [], []
    for _ in range(steps):
        records.append(trainer.train_step())
        masters.append(torch.cat([s.master.detach().clone() for s in trainer.optimizer.shards]))
    return (records if mesh.is_logging_rank else []), masters


def test_overlapped_mean_lands_tau_steps_later():
    """Round ends after step 3; its mean is applied after step 5 (= the groups' weights after
    step 3, averaged); the run's last step (8) syncs every group; bytes leave at step 3."""
    steps = 8
    config = tiny_config(*AVERAGE, f"train.steps={steps}", nproc=2)
    (records, a), (_, b) = run_distributed(2, _masters_per_step, config.to_dict(), steps)
    mean_after_3 = (a[2] + b[2]) / 2
    assert not torch.equal(a[3], b[3])  # step 4: trained on, the mean still in flight
    assert not torch.equal(a[4], a[3])
    assert torch.allclose(a[4], mean_after_3, rtol=0, atol=1e-6)
    assert torch.allclose(b[4], mean_after_3, rtol=0, atol=1e-6)
    assert torch.equal(a[-1], b[-1])  # the last step syncs every group without mixing
    traffic = [r["comm_bytes"]["replica"] for r in records]
    assert traffic[2] > 100 * traffic[3]  # the exchange is issued at the round's end (step 3)
    assert traffic[5] > 100 * traffic[4]  # and the next round's at step 6


def test_mixing_keeps_the_groups_own_progress():
    """outer_mix 0.5: after the delayed step each group's weights are the midpoint of its own
    (trained through step 5) and the outer result (the groups' mean after step 3). A group's
    own weights after step 5 are those of a run whose first round ends later (H = 6): before
    the merge nothing else touches them, so up to step 4 the two runs agree bitwise."""
    steps = 8
    mixed = tiny_config(*AVERAGE[:-1], "train.outer_mix=0.5", f"train.steps={steps}", nproc=2)
    (_, a), (_, b) = run_distributed(2, _masters_per_step, mixed.to_dict(), steps)
    alone = tiny_config("parallel.replicas=2", "parallel.sync_every=6", f"train.steps={steps}",
                        nproc=2)
    (_, own_a), (_, own_b) = run_distributed(2, _masters_per_step, alone.to_dict(), steps)
    assert torch.equal(a[3], own_a[3]) and torch.equal(b[3], own_b[3])
    outer = (own_a[2] + own_b[2]) / 2
    assert torch.allclose(a[4], 0.5 * own_a[4] + 0.5 * outer, rtol=0, atol=1e-6)
    assert torch.allclose(b[4], 0.5 * own_b[4] + 0.5 * outer, rtol=0, atol=1e-6)
    assert not torch.equal(a[4], b[4])  # each group keeps half of its own progress
    assert torch.equal(a[-1], b[-1])


def test_checkpoint_with_a_mean_in_flight_resumes_bitwise(tmp_path):
    """Stopped after step 4 (the mean of step 3 in flight until step 5): the resumed run
    applies it at step 5 and its losses equal the uninterrupted run's bitwise."""
    from tests.parallel.test_checkpoint import resume_and_finish, train_then_stop, uninterrupted

    common = ("parallel.replicas=2", "parallel.sync_every=3", "parallel.sync_overlap=2",
              "train.steps=7")
    saved = tiny_config(*common, run_dir=str(tmp_path / "run"), nproc=2)
    first = run_distributed(2, train_then_stop, saved.to_dict(), 4)[0]
    resumed = tiny_config(*common, "checkpoint.resume=auto", run_dir=str(tmp_path / "run"),
                          nproc=2)
    rest = run_distributed(2, resume_and_finish, resumed.to_dict())[0]
    straight = tiny_config(*common, run_dir=str(tmp_path / "straight"), nproc=2)
    reference = run_distributed(2, uninterrupted, straight.to_dict())[0]
    assert first + rest == reference


@pytest.mark.parametrize("overrides, words", [
    (("parallel.sync_overlap=3",), "below parallel.sync_every = 3"),
    (("parallel.sync_overlap=1", "parallel.outer_grad_dtype=int8"), "fp32 and bf16"),
    (("parallel.sync_overlap=-1",), "at least 0"),
    (("parallel.sync_overlap=1", "train.outer_mix=1"), "[0, 1)"),
])
def test_bad_overlap_settings_are_refused(overrides, words):
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")):
        tiny_config("parallel.replicas=2", "parallel.sync_every=3", *overrides, nproc=2)


def test_overlap_needs_replica_groups():
    from meshtrain.config import ConfigError

    with pytest.raises(ConfigError, match="needs parallel.replicas > 1"):
        tiny_config("parallel.sync_every=3", "parallel.sync_overlap=1", nproc=1)
