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

Robustness (``parallel.outer_aggregate``, :mod:`meshtrain.training.diloco.robust`): before each
exchange every group's pseudo-gradient norm is known everywhere (:meth:`OuterOptimizer.screen`),
a group whose pseudo-gradient is not finite or far larger than the others' is left out, and the
kept ones are combined by a mean, clipped mean, coordinate-wise median or trimmed mean. An outer
gradient that is not finite on any rank is not applied (:meth:`OuterOptimizer.apply`): the
fragment's masters go back to the round's start and the momentum is untouched, so start weights,
momentum and masters (what checkpoints save) never take a non-finite value from a round.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from meshtrain import faults
from meshtrain.config.runtime_facts import fragment_of_parameters
from meshtrain.training.diloco import robust
from meshtrain.training.diloco.quantized_reduce import FORMATS, exchange_reduce
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
    kept: int = 1
    """Groups whose contributions the sum holds (its divisor)."""


class OuterOptimizer:
    """Round bookkeeping, the pseudo-gradient all-reduce and the outer Nesterov step of one rank."""

    def __init__(self, optimizer: FlatAdamW, mesh, sync_every: int, lr: float, momentum: float,
                 grad_dtype: str = "fp32", fragments: int = 1, overlap: int = 0,
                 mix: float = 0.0, aggregate: str = "", max_norm_ratio: float = 10.0):
        """``optimizer``: the inner AdamW, whose fp32 master shards the outer step updates;
        ``mesh``: gives the ``replica`` comms; the rest as the config keys of the same names
        (``overlap`` = ``parallel.sync_overlap``, ``mix`` = ``train.outer_mix``, ``aggregate``
        = ``parallel.outer_aggregate``, ``max_norm_ratio`` = ``parallel.outer_max_norm_ratio``)."""
        self.optimizer = optimizer
        self.engine = optimizer.engine
        self.shards = optimizer.shards
        self.comm = mesh.comm("replica")
        self.replicas = mesh.replicas
        self.group = mesh.replica_rank
        self.world = mesh.comm("world")
        self.device = mesh.device
        self.verbose = mesh.is_logging_rank
        self.aggregate = robust.resolve_aggregate(aggregate, mesh.replicas)
        self.screening = robust.screens(aggregate)
        """False for an explicit ``mean``: the plain mean, no group left out."""
        self.max_norm_ratio = max_norm_ratio
        self.step = 0
        """The inner step whose end is being handled (for the log and test-only faults)."""
        self.rejected: list[int] | None = None
        """The groups left out of the rounds that ended at the last :meth:`end_step` (None: no
        round ended there): ``outer_rejected`` in ``metrics.jsonl``."""
        self.sync_every = sync_every
        self.lr, self.momentum = lr, momentum
        self.quantized = grad_dtype if grad_dtype in FORMATS else ""
        """``int8`` / ``fp8``: the mean is exchanged in 8 bits (:mod:`.quantized_reduce`)."""
        self.grad_dtype = torch.bfloat16 if grad_dtype == "bf16" else torch.float32
        self.start = [self._state_like(shard.master, copy=True) for shard in self.shards]
        """Start-of-round fp32 weights of each shard (the outer parameters)."""
        self.momentum_buf = [self._state_like(shard.master, copy=False) for shard in self.shards]
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

    def _state_like(self, master: torch.Tensor, copy: bool) -> torch.Tensor:
        """A copy of ``master`` (or zeros like it), in the offload store when the inner state
        is offloaded (``parallel.offload``: the outer state lives beside it)."""
        store = self.optimizer.offload
        if store is None:
            return master.detach().clone() if copy else torch.zeros_like(master)
        state = store.zeros(master.numel(), torch.float32)
        if copy:
            store.copy(state, master)
        return state

    @torch.no_grad()
    def end_step(self, step: int, last_step: int) -> None:
        """After inner step ``step``: take the outer steps of the means in flight that are due
        (all of them at ``last_step``), then end the rounds of the fragments due — in the
        background with ``sync_overlap``, else at once (:meth:`sync`). Offloaded state that
        this touched leaves memory again."""
        self._end_step(step, last_step)
        if self.optimizer.offload is not None:
            self.optimizer.offload.release_all()

    def _end_step(self, step: int, last_step: int) -> None:
        self.step, self.rejected = step, None
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
        flats = [self.sent_gradient(f) for f in due]
        verdicts = self.screen(flats)
        self.report(due, verdicts)
        apply_at = min(step + self.overlap, last_step)
        for fragment, flat, verdict in zip(due, flats, verdicts, strict=True):
            if self.aggregate in robust.SUM_AGGREGATES and flat.numel() and verdict.count:
                # The norms are known now: each group's weight goes into its own sum.
                sent = robust.contribution(flat, verdict, self.group, self.aggregate)
                sent = sent.to(self.grad_dtype)
                work = self.sync_comm.all_reduce(sent, async_op=True)
                self.in_flight.append(InFlight(fragment, apply_at, sent, work, verdict.count))
            else:  # coordinate-wise (two dependent exchanges), empty, or no group kept: now
                self.in_flight.append(InFlight(fragment, apply_at,
                                               self._combine(flat, verdict), None))

    def _finish(self, pending: InFlight) -> torch.Tensor:
        """Wait for ``pending``'s exchange and return its fp32 mean (kept in ``pending``)."""
        if pending.work is not None:
            pending.work.wait()
            pending.work = None
            pending.flat = pending.flat.float().div_(pending.kept)
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
            flats = [self.sent_gradient(f) for f in fragments]
            verdicts = self.screen(flats)
            self.report(fragments, verdicts)
            means = [self._combine(flat, v) for flat, v in zip(flats, verdicts, strict=True)]
        self.apply(fragments, means)

    def pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """This rank's fp32 pseudo-gradient (start − now) of ``fragment``, flat."""
        parts = [self.start[i][a:a + n] - self.shards[i].master[a:a + n]
                 for i, a, n in self._runs[fragment]]
        return (torch.cat(parts) if parts else torch.zeros(0)).to(self.device)

    def sent_gradient(self, fragment: int) -> torch.Tensor:
        """:meth:`pseudo_gradient` as this group sends it (a test-only ``poison_outer`` fault,
        :mod:`meshtrain.faults`, may corrupt it before the screening)."""
        flat = self.pseudo_gradient(fragment)
        return faults.poison_outer(flat, self.step, self.group) if faults.active() else flat

    def screen(self, flats: list[torch.Tensor]) -> list[robust.Verdict]:
        """Each fragment's :class:`~meshtrain.training.diloco.robust.Verdict` from every
        group's pseudo-gradient norm, the same on every rank: one all-reduce over the world of
        a float64 ``fragments × groups`` table to which each rank adds its shard's squared norm
        in its group's column, so each entry is the sum over that group's ranks (the gather over
        the ``replica`` comm and the sum inside each group in one call). An element held by
        several ranks of a group (tp-replicated norms, unsharded dp masters) counts once per
        rank: the same in every group, so the comparisons between groups hold."""
        table = torch.zeros(len(flats), self.replicas, dtype=torch.float64, device=self.device)
        for index, flat in enumerate(flats):
            table[index, self.group] = robust.squared_norm(flat)
        if flats:
            self.world.all_reduce(table)
        return [robust.screen(row.tolist(), self.max_norm_ratio, screening=self.screening)
                for row in table]

    def report(self, fragments: list[int], verdicts: list[robust.Verdict]) -> None:
        """Note the groups left out of ``fragments``' rounds (:attr:`rejected`) and say why on
        stderr (logging rank)."""
        rejected = set(self.rejected or ())
        for fragment, verdict in zip(fragments, verdicts, strict=True):
            rejected.update(verdict.rejected)
            where = f" (fragment {fragment})" if self.fragments > 1 else ""
            for group, reason in sorted(verdict.reasons.items()):
                if self.verbose:
                    print(f"meshtrain: step {self.step}: replica group {group} left out of the "
                          f"outer update{where}: {reason}", file=sys.stderr, flush=True)
        self.rejected = sorted(rejected)

    def _combine(self, flat: torch.Tensor, verdict: robust.Verdict) -> torch.Tensor:
        """The fp32 aggregate (``parallel.outer_aggregate``) of ``flat`` over the ``replica``
        comm's kept groups: one all-reduce of each group's contribution in the outer dtype for
        the sum-style aggregates, else the two exchanges of
        :func:`~meshtrain.training.diloco.quantized_reduce.exchange_reduce` (also the 8-bit
        formats' way for every aggregate). All NaN, nothing sent, when no group is kept."""
        if not flat.numel():
            return flat
        if not verdict.count:  # the same on every rank
            return torch.full_like(flat, float("nan"))
        if self.aggregate in robust.SUM_AGGREGATES and not self.quantized:
            sent = robust.contribution(flat, verdict, self.group, self.aggregate)
            sent = sent if sent.dtype == self.grad_dtype else sent.to(self.grad_dtype)
            self.comm.all_reduce(sent)
            return sent.float().div_(verdict.count)
        if not verdict.kept[self.group]:
            flat = torch.zeros_like(flat)  # replaced, never multiplied: NaN × 0 is NaN
        return exchange_reduce(self.comm, flat, self.replicas,
                               lambda rows: robust.combine(rows, verdict, self.aggregate),
                               self.quantized or self.grad_dtype)

    @torch.no_grad()
    def apply(self, fragments: list[int], means: list[torch.Tensor], mix: float = 0.0) -> None:
        """The outer Nesterov step of each of ``fragments`` from its mean pseudo-gradient; the
        results become the fragments' next round's start and, mixed with the masters by
        ``mix`` (0 = replaced), the masters and the parameters. A fragment whose mean is not
        finite on some rank (every rank agrees, one small all-reduce over the world) is not
        stepped: its masters go back to the round's start, its momentum is untouched."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(flat).all()) else 1.0 for flat in means],
                           device=self.device)
        if means:
            self.world.all_reduce(bad)
        for fragment, flat, skip in zip(fragments, means, bad.tolist(), strict=True):
            if skip:
                self._skip(fragment)
                continue
            offset = 0
            for i, a, n in self._runs[fragment]:
                start, master = self.start[i][a:a + n], self.shards[i].master[a:a + n]
                buf = self.momentum_buf[i][a:a + n]
                grad = flat[offset:offset + n].to(start.device)  # offloaded: to the host
                offset += n
                if self.momentum:
                    buf.mul_(self.momentum).add_(grad)
                    grad.add_(buf, alpha=self.momentum)  # Nesterov: Δ̄ + μ b
                start.add_(grad, alpha=-self.lr)
                if mix:
                    master.mul_(mix).add_(start, alpha=1 - mix)
                    torch.where(torch.isfinite(master), master, start, out=master)
                else:
                    master.copy_(start)
            self.rounds += 1
        self.engine.after_step(self.shards)

    def _skip(self, fragment: int) -> None:
        """Leave ``fragment``'s outer state as it is and put its masters back at the round's
        start (the parameters follow in :meth:`apply`)."""
        for i, a, n in self._runs[fragment]:
            self.shards[i].master[a:a + n].copy_(self.start[i][a:a + n])
        self.rounds += 1
        if self.verbose:
            print(f"meshtrain: step {self.step}: the outer update of fragment {fragment} is not "
                  "finite (every replica group left out, or an overflow); skipped it: the "
                  "masters are back at the round's start, the outer momentum is unchanged",
                  file=sys.stderr, flush=True)

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
