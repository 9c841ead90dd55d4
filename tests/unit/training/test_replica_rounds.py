"""The round protocol of fault-tolerant replica groups (:mod:`meshtrain.training.diloco.replica_ft`)
against a stand-in for torchft's manager: a failed round is retried with fresh pseudo-gradients,
a fresh start waits for every group, and a group healed into a live group's sync finishes that
sync. The real manager, lighthouse and a killed group: tests/integration/test_replica_faults.py.
"""

from __future__ import annotations

import types

import torch

from meshtrain.parallel.comm import CommLog
from meshtrain.training.diloco.replica_ft import ReplicaQuorum


class FakeManager:
    """Commits as ``commits`` says (one value per round), reports ``participants`` groups per
    quorum, and runs ``on_quorum`` inside each ``start_quorum`` (where torchft heals)."""

    def __init__(self, commits, participants, on_quorum=lambda: None, step=0):
        self.commits, self.participants = list(commits), list(participants)
        self.on_quorum, self.step, self.quorums, self.sent = on_quorum, step, 0, []

    def start_quorum(self):
        self.quorums += 1
        self.present = self.participants.pop(0) if self.participants else self.present
        self.on_quorum()

    def num_participants(self):
        return self.present

    def current_step(self):
        return self.step

    def errored(self):
        return None

    def allreduce(self, tensor):
        self.sent.append(tensor.clone())
        tensor.div_(self.present)  # as if the other groups sent zeros (so they seem absent)
        return types.SimpleNamespace(wait=lambda: None)

    def should_commit(self):
        ok = self.commits.pop(0)
        self.step += ok
        return ok


def _quorum(manager, step=3):
    gradients = iter([torch.full((4,), 2.0), torch.full((4,), 6.0), torch.full((4,), 8.0)])
    applied = []
    outer = types.SimpleNamespace(grad_dtype=torch.float32, aggregate="mean", screening=True,
                                  max_norm_ratio=10.0, device=torch.device("cpu"),
                                  world=types.SimpleNamespace(all_reduce=lambda t: None),
                                  report=lambda fragments, verdicts: None,
                                  sent_gradient=lambda fragment: next(gradients),
                                  due=lambda s, last: [s % 2],
                                  apply=lambda fragments, means: applied.append((fragments,
                                                                                 means)))
    trainer = types.SimpleNamespace(outer=outer, step=step,
                                    config=types.SimpleNamespace(train=types.SimpleNamespace(
                                        steps=10)))
    quorum = ReplicaQuorum.__new__(ReplicaQuorum)
    quorum.trainer, quorum.manager, quorum.groups = trainer, manager, 2
    quorum.mesh = types.SimpleNamespace(is_logging_rank=False, comm_log=CommLog(),
                                        replica_rank=1)
    quorum.phase, quorum.healed_phase, quorum.present, quorum.retries = "join", None, 0, 0
    return quorum, applied


def test_a_failed_round_is_retried_with_fresh_pseudo_gradients():
    manager = FakeManager(commits=[False, True], participants=[2, 1], step=5)
    quorum, _ = _quorum(manager)
    fragments, means = quorum.sync([0])
    assert (fragments, quorum.retries, manager.quorums, quorum.present) == ([0], 1, 2, 1)
    # recomputed for the retry (the float64 tensors are the groups' norms, sent first)
    assert [float(t[0]) for t in manager.sent if t.dtype == torch.float32] == [2.0, 6.0]
    assert float(means[0][0]) == 6.0  # the committed round had this group alone
    assert quorum.mesh.comm_log.calls["replica"] == 4


def test_a_fresh_start_waits_for_every_group():
    manager = FakeManager(commits=[True], participants=[1, 1, 2])
    quorum, applied = _quorum(manager, step=0)
    quorum.join()
    assert (manager.quorums, manager.sent, applied, quorum.present) == (3, [], [], 2)


def test_a_group_healed_into_a_sync_finishes_it():
    """Healed at the live group's step 7 in its sync: the fragment due at step 7 is averaged in
    the same round and the outer step applied."""
    quorum = None

    def heal():
        if manager.quorums == 1:
            quorum.trainer.step, quorum.healed_phase = 7, "sync"
            manager.step = 4

    manager = FakeManager(commits=[True], participants=[2], on_quorum=heal)
    quorum, applied = _quorum(manager, step=0)
    quorum.join()
    assert manager.quorums == 1
    assert [float(t[0]) for t in manager.sent if t.dtype == torch.float32] == [2.0]
    assert [(fragments, float(means[0][0])) for fragments, means in applied] == [([1], 2.0)]
