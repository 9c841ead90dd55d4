"""Replica groups that fail alone: DiLoCo's outer sync through torchft (docs/diloco.md).

With ``parallel.replica_fault_tolerance`` every replica group is a job of its own (its world is
its inner layout) and every rank holds a ``torchft.Manager``. The managers of one group share a
store hosted by the group's rank 0; the group's rank 0 also runs torchft's manager server, which
asks the lighthouse (``parallel.lighthouse`` or ``TORCHFT_LIGHTHOUSE``) for a **quorum**: the
groups alive and asking at that moment. torchft is the engine for quorum, reconfiguring the
process group between the groups present and healing a restarted group; meshtrain does not
re-implement them on torch.distributed.

The manager's step counts committed **rounds**: a group's start (the join) and each sync event
(an inner step at which one or more fragments end their DiLoCo round). One round is

1. ``start_quorum``: the lighthouse forms a quorum. A group whose step is behind the quorum's
   highest **heals**: each of its ranks fetches the same rank's state from a live group at that
   moment (:meth:`ReplicaQuorum.state_dict`: inner step, masters, AdamW moments and step, the
   outer start weights, momentum and round count, persistent buffers, the data position, and
   whether that group was joining or syncing) and loads it, so it continues in sync;
2. in a sync, one all-reduce per due fragment of the pseudo-gradient over the groups in the
   quorum, divided by their number (``num_participants``);
3. ``should_commit``: only when every rank of the group agrees the round succeeded are the outer
   steps applied. Otherwise (a group died during it) the round is retried with a new quorum.

Per-step metrics stay inside the group (nothing per step crosses groups, so no step waits for a
dead group). At a fresh start (no group has committed a round) a group asks for quorums until
all ``parallel.replicas`` groups are in, at most :data:`JOIN_WAIT_S`, so groups started seconds
apart begin together; a group started later than that heals from the others instead.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

JOIN_WAIT_S = 60.0
"""Longest wait at a fresh start for every replica group to join before starting without some."""


def _group_store(mesh) -> tuple[str, int, object]:
    """(host, port, store) of the TCPStore the group's managers share, hosted by the group's rank
    0 (``store`` is None elsewhere); it must outlive the managers."""
    host = os.environ.get("MESHTRAIN_FT_HOST") or socket.gethostname()
    store = None
    if mesh.rank == 0:
        store = dist.TCPStore(host, 0, mesh.world_size, is_master=True, wait_for_workers=False)
    where = [host, store.port if store is not None else 0]
    if mesh.world_size > 1:
        dist.broadcast_object_list(where, src=0)
    return str(where[0]), int(where[1]), store


def lighthouse_address(configured: str) -> str:
    """``parallel.lighthouse`` (else ``TORCHFT_LIGHTHOUSE``) as torchft takes it: with a scheme
    (``HOST:PORT`` becomes ``http://HOST:PORT``)."""
    address = configured or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    return address if "://" in address else f"http://{address}"


def quiet_torchft() -> None:
    """torchft's Rust side logs every quorum at INFO and its manager warns on CPU that it cannot
    reset NCCL's flight recorder: keep warnings of the Rust side (``RUST_LOG`` set by the user
    wins) and errors of the Python side."""
    import logging

    os.environ.setdefault("RUST_LOG", "warn")
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)


class ReplicaQuorum:
    """This rank's torchft manager and the rounds of a fault-tolerant run (module docstring)."""

    def __init__(self, trainer):
        """``trainer``: the :class:`~meshtrain.training.trainer.Trainer` whose state heals a
        restarted group and whose :class:`~meshtrain.training.diloco.outer.OuterOptimizer` syncs."""
        quiet_torchft()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        self.trainer = trainer
        mesh, par = trainer.mesh, trainer.config.parallel
        self.mesh, self.groups = mesh, par.replicas
        self.phase = "join"
        """What this group is doing in the current round: ``join`` or ``sync``."""
        self.healed_phase: str | None = None
        """The phase of the group this one healed from in the current round (None: no heal)."""
        self.present = 0
        """Groups in the last committed round."""
        self.retries = 0
        """Rounds retried because one failed (a group died during it)."""
        host, port, self._store = _group_store(mesh)
        timeout = datetime.timedelta(seconds=trainer.config.train.collective_timeout_s)
        group = (ProcessGroupNCCL(timeout=timeout) if mesh.device.type == "cuda"
                 else ProcessGroupGloo(timeout=timeout))
        self.manager = Manager(
            pg=group, load_state_dict=self.load_state_dict, state_dict=self.state_dict,
            min_replica_size=1, use_async_quorum=False, timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=par.quorum_timeout_s),
            rank=mesh.rank, world_size=mesh.world_size, store_addr=host, store_port=port,
            lighthouse_addr=lighthouse_address(par.lighthouse), hostname=host, init_sync=False,
            replica_id=f"meshtrain_group{mesh.replica_rank}")

    # ------------------------------------------------------------------ healing
    def state_dict(self) -> dict:
        """This rank's state for a group that heals from this one (called by torchft while this
        group is inside :meth:`_round`; in a sync, the inner step is done and its sync pending)."""
        trainer = self.trainer
        optimizer, outer = trainer.optimizer, trainer.outer
        persistent = set(trainer.model.state_dict().keys())
        return {
            "phase": self.phase,
            "step": trainer.step + (1 if self.phase == "sync" else 0),
            "optimizer_step": optimizer.step_count, "outer_rounds": outer.rounds,
            "master": [s.master.detach().clone() for s in optimizer.shards],
            "exp_avg": [t.clone() for t in optimizer.exp_avg],
            "exp_avg_sq": [t.clone() for t in optimizer.exp_avg_sq],
            "outer_start": [t.clone() for t in outer.start],
            "outer_momentum": [t.clone() for t in outer.momentum_buf],
            "buffers": {name: buf.clone() for name, buf in trainer.model.named_buffers()
                        if name in persistent},
            "data": trainer.data.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Continue from a live group's :meth:`state_dict` (same inner layout, same rank)."""
        trainer = self.trainer
        optimizer, outer = trainer.optimizer, trainer.outer
        targets = {"master": [s.master for s in optimizer.shards],
                   "exp_avg": optimizer.exp_avg, "exp_avg_sq": optimizer.exp_avg_sq,
                   "outer_start": outer.start, "outer_momentum": outer.momentum_buf}
        for key, tensors in targets.items():
            for mine, theirs in zip(tensors, state[key], strict=True):
                mine.copy_(theirs)
        buffers = dict(trainer.model.named_buffers())
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
        # Inside a sync this group's trainer counts the pending step itself once it returns.
        trainer.step = state["step"] - (1 if self.phase == "sync" else 0)
        optimizer.step_count = state["optimizer_step"]
        outer.rounds = state["outer_rounds"]
        trainer.data.load_state_dict(state["data"])
        trainer.engine.after_step(optimizer.shards)  # parameters from the loaded masters
        self.healed_phase = state["phase"]

    # ------------------------------------------------------------------ rounds
    def join(self) -> None:
        """Start (or restart) this group: one round with the others, healing from them when they
        are ahead. Called once before the first step, after any checkpoint was restored."""
        trainer = self.trainer
        last = trainer.config.train.steps
        if self.mesh.is_logging_rank:
            print(f"meshtrain: replica group {self.mesh.replica_rank} of {self.groups} joining "
                  "the others through the lighthouse", file=sys.stderr, flush=True)
        if trainer.step:  # resumed: the rounds this group committed up to its step
            done = 1 + sum(1 for s in range(1, trainer.step + 1) if trainer.outer.due(s, last))
            self.manager.load_state_dict({"step": done, "batches_committed": 0})
        phase, fragments, means = self._round("join", lambda: trainer.outer.due(trainer.step,
                                                                                last))
        if phase == "sync":  # healed from a group in its sync: finish that sync with it
            trainer.outer.apply(fragments, means)
        if self.healed_phase is not None and self.mesh.is_logging_rank:
            print(f"meshtrain: replica group {self.mesh.replica_rank} rejoined at step "
                  f"{trainer.step} from a live group ({self.present} groups present)",
                  file=sys.stderr, flush=True)

    def sync(self, fragments: list[int]) -> tuple[list[int], list[torch.Tensor]]:
        """The mean pseudo-gradients of ``fragments`` over the groups present (a committed
        round); returns (fragments, means): other fragments only if this group healed."""
        trainer = self.trainer
        last = trainer.config.train.steps

        def due() -> list[int]:
            return fragments if self.healed_phase is None else trainer.outer.due(
                trainer.step + 1, last)

        _, synced, means = self._round("sync", due)
        return synced, means

    def _round(self, phase: str, due) -> tuple[str, list[int], list[torch.Tensor]]:
        """Run rounds until one commits; returns (the phase it was, fragments, their means)."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while True:
            self.phase, self.healed_phase = phase, None
            self.manager.start_quorum()
            current = self.healed_phase or phase
            fresh = current == "join" and self.manager.current_step() == 0
            if (fresh and self.manager.num_participants() < self.groups
                    and time.monotonic() < deadline and self.manager.errored() is None):
                time.sleep(0.2)  # a fresh start: wait for the groups still starting
                continue
            fragments = due() if current == "sync" else []
            means = [self._mean(self.trainer.outer.pseudo_gradient(f)) for f in fragments]
            if self.manager.should_commit():
                self.present = self.manager.num_participants()
                return current, fragments, means
            self.retries += 1
            if self.mesh.is_logging_rank:
                print(f"meshtrain: replica group {self.mesh.replica_rank}: a round with the "
                      f"other groups failed ({self.manager.errored()}); retrying with the "
                      "groups present", file=sys.stderr, flush=True)

    def _mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The mean of ``flat`` over the groups in the quorum, fp32 (sent in the outer dtype)."""
        if flat.numel() == 0:
            return flat
        outer = self.trainer.outer
        sent = flat if flat.dtype == outer.grad_dtype else flat.to(outer.grad_dtype)
        entry = self.mesh.comm_log.record("replica", "all_reduce", sent.shape, sent.dtype,
                                          sent.numel() * sent.element_size(),
                                          self.manager.num_participants())
        began = time.perf_counter()
        self.manager.allreduce(sent).wait()  # in place: sum / num_participants
        self.mesh.comm_log.wait_s += time.perf_counter() - began
        entry.done = True
        return sent.float()

    def shutdown(self) -> None:
        """Leave the quorum (the group's store stays up until the process ends)."""
        self.manager.shutdown(wait=False)
