"""DiLoCo's outer step between replica groups (``parallel.replicas > 1``; docs/diloco.md).

Each replica group trains ``parallel.sync_every = H`` inner AdamW steps on its own part of every
global batch; then, on every rank, the round's **pseudo-gradient** of this rank's fp32 master
shard,

    Δ = θ_start − θ_now,

is averaged over the ``replica`` group (the ranks with the same inner coordinates in every
group, which hold the same shard), and one outer Nesterov SGD step (PyTorch's ``SGD(nesterov=
True)`` with dampening 0, Douillard et al. 2023) moves the round's start weights:

    b ← μ b + Δ̄;   θ_start ← θ_start − η (Δ̄ + μ b)

(η = ``train.outer_lr``, μ = ``train.outer_momentum``). The result becomes the fp32 masters (and
so the parameters) of every group and the next round's start. The inner AdamW moments are kept
across rounds, as DiLoCo does.

The outer state (start weights and momentum buffer) is kept per optimizer shard, so it is
ZeRO-sharded exactly where the inner layout shards the masters: 8 bytes per parameter this rank
owns. The pseudo-gradient is all-reduced in ``parallel.outer_grad_dtype`` (fp32 or bf16), or
its mean exchanged in 8 bits with per-block scales (int8 or fp8,
:mod:`meshtrain.training.diloco.quantized_reduce`); the outer step itself is fp32. Either goes
through the mesh's counted ``replica`` comm, so its traffic is ``comm_bytes.replica``.

Streaming (``parallel.sync_fragments = F``, Streaming DiLoCo, Douillard et al. 2025): the model's
parameters are split into F fragments of consecutive blocks (the embedding with the first, the
final norm and head with the last; each unit goes to the fragment its midpoint falls in, by
element count, so fragments are about equally large), and fragment ``f`` ends its rounds at the
inner steps ``s`` with ``s mod H = (f + 1)·H/F mod H``: every fragment still syncs once per H
steps, but at a different step, so the largest per-step traffic falls about F ×. All fragments
sync at the run's last step.

Overlapped communication (``parallel.sync_overlap = τ``, Streaming DiLoCo): when a fragment's
round ends after inner step ``s``, its pseudo-gradient is all-reduced in the background (on the
mesh's own ``replica_sync`` group, so the per-step reductions over ``replica`` do not queue
behind it) while the group trains steps ``s + 1 .. s + τ``; after step ``s + τ`` the outer step
is taken from that mean, and the fragment's weights become

    θ ← α θ + (1 − α) θ_start      (α = ``train.outer_mix``)

the group's own weights (trained τ more steps) mixed with the outer result, which is the next
round's start. At the run's last step every mean in flight is applied, then every fragment
syncs at once without mixing, so all groups end with the same weights. A checkpoint taken
while means are in flight waits for them and saves them (``outer.pending``), so a resumed run
applies them at the same steps.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.config.runtime_facts import fragment_of_parameters
from meshtrain.training.diloco.quantized_reduce import FORMATS, quantized_mean
from meshtrain.training.optimizer import FlatAdamW


@dataclasses.dataclass(eq=False)
class InFlight:
    """A fragment's pseudo-gradient exchange running in the background."""

    fragment: int
    apply_at: int
    """The inner step after which its outer step is taken."""
    flat: torch.Tensor
    """The sum being all-reduced (outer dtype), or the fp32 mean once ``work`` is None."""
    work: object | None


class OuterOptimizer:
    """Round bookkeeping, the pseudo-gradient all-reduce and the outer Nesterov step of one rank."""

    def __init__(self, optimizer: FlatAdamW, mesh, sync_every: int, lr: float, momentum: float,
                 grad_dtype: str = "fp32", fragments: int = 1, overlap: int = 0,
                 mix: float = 0.0):
        """``optimizer``: the inner AdamW, whose fp32 master shards the outer step updates;
        ``mesh``: gives the ``replica`` comms; the rest as the config keys of the same names
        (``overlap`` = ``parallel.sync_overlap``, ``mix`` = ``train.outer_mix``)."""
        self.optimizer = optimizer
        self.engine = optimizer.engine
        self.shards = optimizer.shards
        self.comm = mesh.comm("replica")
        self.replicas = mesh.replicas
        self.sync_every = sync_every
        self.lr, self.momentum = lr, momentum
        self.quantized = grad_dtype if grad_dtype in FORMATS else ""
        """``int8`` / ``fp8``: the mean is exchanged in 8 bits (:mod:`.quantized_reduce`)."""
        self.grad_dtype = torch.bfloat16 if grad_dtype == "bf16" else torch.float32
        self.start = [shard.master.detach().clone() for shard in self.shards]
        """Start-of-round fp32 weights of each shard (the outer parameters)."""
        self.momentum_buf = [torch.zeros_like(shard.master) for shard in self.shards]
        self.rounds = 0
        """Outer steps taken (one per fragment synced)."""
        self.fragments = fragments
        self._runs = self._fragment_runs(fragments)
        self.overlap, self.mix = overlap, mix
        self.sync_comm = mesh.comm("replica_sync")
        self.in_flight: list[InFlight] = []
        self.quorum = None
        """A :class:`~meshtrain.training.diloco.replica_ft.ReplicaQuorum` when the replica groups
        are
        separate jobs (``parallel.replica_fault_tolerance``), else None (the mesh's comm)."""

    def _fragment_runs(self, fragments: int) -> list[list[tuple[int, int, int]]]:
        """``(shard index, start, length)`` runs of each fragment's elements in the shards."""
        if fragments == 1:
            return [[(i, 0, s.master.numel()) for i, s in enumerate(self.shards)]]
        slots = [slot for shard in self.shards for slot in shard.bucket.slots]
        fragment = fragment_of_parameters([(s.name, s.numel) for s in slots], fragments)
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(fragments)]
        for index, shard in enumerate(self.shards):
            for slot, start, length in shard.bucket.segments(sharded=self.engine.stage >= 1):
                mine = runs[fragment[slot.name]]
                if mine and mine[-1][0] == index and sum(mine[-1][1:]) == start:
                    mine[-1] = (index, mine[-1][1], mine[-1][2] + length)
                else:
                    mine.append((index, start, length))
        return runs

    def due(self, step: int, last_step: int) -> list[int]:
        """The fragments whose round ends after inner step ``step`` (1-based): fragment ``f`` at
        ``step mod H = (f + 1)·H/F mod H`` (all of them every H steps when F = 1), and every
        fragment at the run's last step, so that all groups end with the same weights."""
        if step == last_step:
            return list(range(self.fragments))
        every = self.sync_every
        return [f for f in range(self.fragments)
                if step % every == (f + 1) * every // self.fragments % every]

    @torch.no_grad()
    def end_step(self, step: int, last_step: int) -> None:
        """After inner step ``step``: take the outer steps of the means in flight that are due
        (all of them at ``last_step``), then end the rounds of the fragments due — in the
        background with ``sync_overlap``, else at once (:meth:`sync`)."""
        ready = [p for p in self.in_flight if p.apply_at <= step or step == last_step]
        if ready:
            self.in_flight = [p for p in self.in_flight if p not in ready]
            self.apply([p.fragment for p in ready], [self._finish(p) for p in ready], self.mix)
        due = self.due(step, last_step)
        if not due:
            return
        if not self.overlap or step == last_step:
            self.sync(due)
            return
        for fragment in due:
            flat = self.pseudo_gradient(fragment).to(self.grad_dtype)
            work = self.sync_comm.all_reduce(flat, async_op=True) if flat.numel() else None
            self.in_flight.append(InFlight(fragment, min(step + self.overlap, last_step), flat,
                                           work))

    def _finish(self, pending: InFlight) -> torch.Tensor:
        """Wait for ``pending``'s exchange and return its fp32 mean (kept in ``pending``)."""
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
            pending.flat = pending.flat.float().div_(self.replicas)
        return pending.flat

    def pending_buffers(self) -> list[torch.Tensor]:
        """The means in flight, finished and laid out like the masters (zero elsewhere), for a
        checkpoint (``outer.pending``)."""
        buffers = [torch.zeros_like(shard.master) for shard in self.shards]
        for pending in self.in_flight:
            self._scatter(pending.fragment, self._finish(pending), buffers)
        return buffers

    def restore_pending(self, entries: list, buffers: list[torch.Tensor] | None) -> None:
        """Put back the means in flight of a checkpoint: ``entries`` ``[fragment, apply_at]``,
        their values in ``buffers`` (laid out like the masters)."""
        self.in_flight = []
        for fragment, apply_at in entries:
            flat = torch.cat([buffers[i][a:a + n] for i, a, n in self._runs[fragment]]
                             or [torch.zeros(0)])
            self.in_flight.append(InFlight(int(fragment), int(apply_at), flat, None))

    def _scatter(self, fragment: int, flat: torch.Tensor, buffers: list[torch.Tensor]) -> None:
        offset = 0
        for i, a, n in self._runs[fragment]:
            buffers[i][a:a + n].copy_(flat[offset:offset + n])
            offset += n

    @torch.no_grad()
    def sync(self, fragments: list[int] | None = None) -> None:
        """Average the pseudo-gradients of ``fragments`` (default: all) over the replica groups
        in one all-reduce each, take the outer step, and write the new weights into the masters,
        the parameters and those fragments' next round's start. With fault-tolerant groups
        (:attr:`quorum`) the mean is over the groups present, through torchft."""
        fragments = list(range(self.fragments)) if fragments is None else fragments
        if self.quorum is not None:
            fragments, means = self.quorum.sync(fragments)
        else:
            means = [self._mean(self.pseudo_gradient(f)) for f in fragments]
        self.apply(fragments, means)

    def pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """This rank's fp32 pseudo-gradient (start − now) of ``fragment``, flat."""
        parts = [self.start[i][a:a + n] - self.shards[i].master[a:a + n]
                 for i, a, n in self._runs[fragment]]
        return torch.cat(parts) if parts else torch.zeros(0)

    def _mean(self, flat: torch.Tensor) -> torch.Tensor:
        """The fp32 mean of ``flat`` over the ``replica`` comm, sent in the outer dtype."""
        if not flat.numel():
            return flat
        if self.quantized:
            return quantized_mean(self.comm, flat, self.replicas, self.quantized)
        flat = flat if flat.dtype == self.grad_dtype else flat.to(self.grad_dtype)
        self.comm.all_reduce(flat)
        return flat.float().div_(self.replicas)

    @torch.no_grad()
    def apply(self, fragments: list[int], means: list[torch.Tensor], mix: float = 0.0) -> None:
        """The outer Nesterov step of each of ``fragments`` from its mean pseudo-gradient; the
        results become the fragments' next round's start and, mixed with the masters by
        ``mix`` (0 = replaced), the masters and the parameters."""
        for fragment, flat in zip(fragments, means, strict=True):
            offset = 0
            for i, a, n in self._runs[fragment]:
                start, master = self.start[i][a:a + n], self.shards[i].master[a:a + n]
                buf = self.momentum_buf[i][a:a + n]
                grad = flat[offset:offset + n]
                offset += n
                if self.momentum:
                    buf.mul_(self.momentum).add_(grad)
                    grad.add_(buf, alpha=self.momentum)  # Nesterov: Δ̄ + μ b
                start.add_(grad, alpha=-self.lr)
                if mix:
                    master.mul_(mix).add_(start, alpha=1 - mix)
                else:
                    master.copy_(start)
            self.rounds += 1
        self.engine.after_step(self.shards)

    @torch.no_grad()
    def restart_round(self) -> None:
        """Start a round from the current masters (after loading weights into them)."""
        for start, shard in zip(self.start, self.shards, strict=True):
            start.copy_(shard.master)

    def state_bytes(self) -> int:
        """Bytes of outer state this rank holds (start weights and momentum)."""
        return sum(t.numel() * t.element_size() for t in self.start + self.momentum_buf)


def reduce_over_groups(mesh, losses: torch.Tensor, grad_norm: torch.Tensor,
                       global_tokens: float) -> tuple[torch.Tensor, torch.Tensor, float, list]:
    """A step's (loss, aux, energy) ``losses``, gradient norm and tokens over the replica groups
    of this world: loss, aux and norm the mean over the groups (each its own batch's), energy
    and tokens the sum, and the tokens of each group. A group that is a job of its own (fault
    tolerance) keeps its own values: no per-step collective waits for another group."""
    comm = mesh.comm("replica")
    own_tokens = losses.new_zeros(mesh.replicas)  # this group's slot: tokens per group
    own_tokens[mesh.replica_rank] = global_tokens
    losses = torch.cat([losses, torch.stack([grad_norm.float().reshape(()),
                                             losses.new_tensor(global_tokens)]), own_tokens])
    comm.all_reduce(losses)
    losses[:2] /= comm.size
    return losses, losses[3] / comm.size, float(losses[4]), [int(n) for n in losses[5:].tolist()]
