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
   moment (:meth:`ReplicaQuorum.state_dict`: inner step, masters, the outer start weights,
   momentum and round count, persistent buffers, the data position's step, and whether that
   group was joining or syncing; its AdamW moments only with ``parallel.heal_inner_state``),
   checks it against its own (:meth:`ReplicaQuorum.check_heal_state`) and loads it, so it
   continues in sync. The state travels as safetensors, never pickled
   (:mod:`.heal_transport`);
2. in a sync, the groups' pseudo-gradient norms are exchanged and screened, then each due
   fragment's robust aggregate is formed over the groups in the quorum
   (:func:`~meshtrain.training.diloco.robust.quorum_aggregate`);
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
import sys
import time

import torch

JOIN_WAIT_S = 60.0
"""Longest wait at a fresh start for every replica group to join before starting without some."""


def _group_store(mesh, network) -> tuple[str, int, object]:
    """(host, port, store) of the TCPStore the group's managers share, hosted by the group's rank
    0 (``store`` is None elsewhere); it must outlive the managers. ``network``
    (:class:`~meshtrain.host.ft_network.GroupNetwork`) says where it listens: on loopback when
    the lighthouse and the groups are on this machine."""
    store = network.store(mesh.world_size) if mesh.rank == 0 else None
    where = [network.host, store.port if store is not None else 0]
    if mesh.world_size > 1:
        where = mesh.comm("world").all_gather_json(where)[0]  # rank 0's (JSON, no pickle)
    return str(where[0]), int(where[1]), store


def lighthouse_address(configured: str) -> str:
    """``parallel.lighthouse`` (else ``TORCHFT_LIGHTHOUSE``) as torchft takes it: with a scheme
    (``HOST:PORT`` becomes ``http://HOST:PORT``). With ``parallel.tls_dir`` torchft is handed a
    local TLS forwarder's address instead (:class:`~meshtrain.host.ft_network.GroupNetwork`)."""
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
        from meshtrain.host.ft_network import GroupNetwork

        # where the store, manager server and heal transport listen; the lighthouse link
        self._network = GroupNetwork.plan(
            lighthouse_address(par.lighthouse), par.tls_dir, par.insecure_network, mesh.rank,
            mesh.world_size, announce=mesh.is_logging_rank)
        host, port, self._store = _group_store(mesh, self._network)
        timeout = datetime.timedelta(seconds=trainer.config.train.collective_timeout_s)
        group = (ProcessGroupNCCL(timeout=timeout) if mesh.device.type == "cuda"
                 else ProcessGroupGloo(timeout=timeout))
        with self._network.manager_server():
            self.manager = Manager(
                pg=group, load_state_dict=self.load_state_dict, state_dict=self.state_dict,
                min_replica_size=1, use_async_quorum=False, timeout=timeout,
                quorum_timeout=datetime.timedelta(seconds=par.quorum_timeout_s),
                rank=mesh.rank, world_size=mesh.world_size, store_addr=host, store_port=port,
                lighthouse_addr=self._network.lighthouse, hostname=host, init_sync=False,
                checkpoint_transport=self._heal_transport(),
                replica_id=f"meshtrain_group{mesh.replica_rank}")

    def _heal_transport(self):
        """The heal transport torchft uses (:class:`.heal_transport.SafeHeal`): listening where
        the group's network says, HTTPS with client certificates under ``parallel.tls_dir``,
        reading at most this rank's own state's size from a peer."""
        from meshtrain.training.diloco.heal_transport import SafeHeal

        network, credentials = self._network, self._network.credentials
        return SafeHeal(network.bind or "0.0.0.0", network.host, self.heal_bytes(),
                        credentials.server_context() if credentials else None,
                        credentials.client_context() if credentials else None)

    # ------------------------------------------------------------------ healing
    def state_dict(self) -> dict:
        """This rank's state for a group that heals from this one (called by torchft while this
        group is inside :meth:`_round`; in a sync, the inner step is done and its sync pending).

        Only what the joining group needs: the masters, the outer start weights and momentum,
        persistent buffers, the step counts and the data position's step (a number every group
        shares). The inner AdamW moments, which carry this group's gradients, only with
        ``parallel.heal_inner_state`` (this group's opt-in). Sent without pickle
        (:mod:`.heal_transport`)."""
        trainer = self.trainer
        optimizer, outer = trainer.optimizer, trainer.outer
        persistent = set(trainer.model.state_dict().keys())
        state = {
            "phase": self.phase,
            "step": trainer.step + (1 if self.phase == "sync" else 0),
            "optimizer_step": optimizer.step_count, "outer_rounds": outer.rounds,
            "master": [s.master.detach().clone() for s in optimizer.shards],
            "outer_start": [t.clone() for t in outer.start],
            "outer_momentum": [t.clone() for t in outer.momentum_buf],
            "buffers": {name: buf.clone() for name, buf in trainer.model.named_buffers()
                        if name in persistent},
            "data_step": int(trainer.data.state_dict()["step"]),
        }
        if trainer.config.parallel.heal_inner_state:
            state["exp_avg"] = [t.clone() for t in optimizer.exp_avg]
            state["exp_avg_sq"] = [t.clone() for t in optimizer.exp_avg_sq]
        return state

    def _heal_targets(self, inner: bool) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors a heal overwrites, by :meth:`state_dict` key."""
        optimizer, outer = self.trainer.optimizer, self.trainer.outer
        targets = {"master": [s.master for s in optimizer.shards],
                   "outer_start": outer.start, "outer_momentum": outer.momentum_buf}
        if inner:
            targets.update(exp_avg=optimizer.exp_avg, exp_avg_sq=optimizer.exp_avg_sq)
        return targets

    def heal_bytes(self) -> int:
        """The most bytes a peer's state for this rank can take: this rank's own, inner moments
        included, plus room for the JSON tree (the heal transport's read limit)."""
        tensors = [t for ts in self._heal_targets(True).values() for t in ts]
        tensors += [b for b in self.trainer.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors) + (1 << 20) * (
            1 + len(tensors) // 1000)

    def check_heal_state(self, state: object) -> None:
        """Refuse (ValueError) a peer's state that does not match this rank's own: unknown or
        missing keys, another number of tensors, another shape or dtype, a value that is not
        finite, a step outside the run. Nothing is copied before this passes."""
        if not isinstance(state, dict):
            raise ValueError("heal: the peer's state is not a mapping")
        inner = "exp_avg" in state
        targets = self._heal_targets(inner)
        expected = {"phase", "step", "optimizer_step", "outer_rounds", "buffers", "data_step",
                    *targets}
        if set(state) != expected:
            raise ValueError(f"heal: the peer's state has keys {sorted(state)}, expected "
                             f"{sorted(expected)}")
        last = self.trainer.config.train.steps
        for key in ("step", "optimizer_step", "outer_rounds", "data_step"):
            value = state[key]
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= (
                    last + 1) * max(1, self.trainer.outer.fragments):
                raise ValueError(f"heal: the peer's {key} = {value!r} is not a step of this run")
        if state["phase"] not in ("join", "sync"):
            raise ValueError(f"heal: the peer's phase {state['phase']!r} is not join or sync")
        persistent = set(self.trainer.model.state_dict().keys())
        mine_buffers = {n: b for n, b in self.trainer.model.named_buffers() if n in persistent}
        theirs = state["buffers"]
        if not isinstance(theirs, dict) or set(theirs) != set(mine_buffers):
            raise ValueError("heal: the peer's buffers are not this model's")
        pairs = [(f"buffers.{n}", mine_buffers[n], theirs[n]) for n in mine_buffers]
        for key, tensors in targets.items():
            got = state[key]
            if not isinstance(got, list) or len(got) != len(tensors):
                raise ValueError(f"heal: the peer sends {key} in another number of shards")
            pairs += [(f"{key}[{i}]", mine, t)
                      for i, (mine, t) in enumerate(zip(tensors, got, strict=True))]
        for name, mine, value in pairs:
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"heal: the peer's {name} is not a tensor")
            if value.shape != mine.shape or value.dtype != mine.dtype:
                raise ValueError(f"heal: the peer's {name} is {tuple(value.shape)} "
                                 f"{value.dtype}, this rank's is {tuple(mine.shape)} "
                                 f"{mine.dtype} (another layout or model?)")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise ValueError(f"heal: the peer's {name} holds values that are not finite")

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Continue from a live group's :meth:`state_dict` (same inner layout, same rank), after
        :meth:`check_heal_state`. Without the peer's inner moments this group's start from zero
        (AdamW's step count too, so its bias correction starts over)."""
        self.check_heal_state(state)
        trainer = self.trainer
        optimizer, outer = trainer.optimizer, trainer.outer
        inner = "exp_avg" in state
        for key, tensors in self._heal_targets(inner).items():
            for mine, theirs in zip(tensors, state[key], strict=True):
                mine.copy_(theirs)
        buffers = dict(trainer.model.named_buffers())
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
        # Inside a sync this group's trainer counts the pending step itself once it returns.
        trainer.step = state["step"] - (1 if self.phase == "sync" else 0)
        if inner:
            optimizer.step_count = state["optimizer_step"]
        else:
            for tensor in (*optimizer.exp_avg, *optimizer.exp_avg_sq):
                tensor.zero_()
            optimizer.step_count = 0
        outer.rounds = state["outer_rounds"]
        trainer.data.load_state_dict({**trainer.data.state_dict(), "step": state["data_step"]})
        trainer.engine.after_step(optimizer.shards)  # parameters from the loaded masters
        self.healed_phase = state["phase"]
        self.healed_inner = inner

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
            means, verdicts = self._mean(fragments)
            if self.manager.should_commit():
                self.present = self.manager.num_participants()
                if fragments:  # who was left out, now that the round counts
                    self.trainer.outer.report(fragments, verdicts)
                return current, fragments, means
            self.retries += 1
            if self.mesh.is_logging_rank:
                print(f"meshtrain: replica group {self.mesh.replica_rank}: a round with the "
                      f"other groups failed ({self.manager.errored()}); retrying with the "
                      "groups present", file=sys.stderr, flush=True)

    def _mean(self, fragments: list[int]) -> tuple[list[torch.Tensor], list]:
        """The outer gradients (fp32, ``parallel.outer_aggregate`` over the groups in the
        quorum that pass the screening) of ``fragments``, and each one's
        :class:`~meshtrain.training.diloco.robust.Verdict`, by
        :func:`~meshtrain.training.diloco.robust.quorum_aggregate`: a small all-reduce of every
        group's norms first, then one all-reduce per fragment in the outer dtype (``groups`` ×
        the bytes for ``median`` and ``trimmed-mean``: torchft offers no all-to-all)."""
        from meshtrain.training.diloco import robust

        if not fragments:
            return [], []
        outer = self.trainer.outer
        participants = self.manager.num_participants()

        def allreduce_mean(sent: torch.Tensor) -> None:  # in place: sum / num_participants
            entry = self.mesh.comm_log.record("replica", "all_reduce", sent.shape, sent.dtype,
                                              sent.numel() * sent.element_size(), participants)
            began = time.perf_counter()
            self.manager.allreduce(sent).wait()
            self.mesh.comm_log.wait_s += time.perf_counter() - began
            entry.done = True

        return robust.quorum_aggregate(
            [outer.sent_gradient(f) for f in fragments], self.mesh.replica_rank, self.groups,
            outer.aggregate, outer.max_norm_ratio, outer.grad_dtype, participants,
            allreduce_mean, outer.world.all_reduce, outer.device, outer.screening)

    def shutdown(self) -> None:
        """Leave the quorum (the group's store stays up until the process ends)."""
        self.manager.shutdown(wait=False)
