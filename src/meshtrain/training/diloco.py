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
owns. The pseudo-gradient is all-reduced in ``parallel.outer_grad_dtype`` (fp32 or bf16; the
outer step itself is fp32), through the mesh's counted ``replica`` comm, so its traffic is
``comm_bytes.replica``.
"""

from __future__ import annotations

import torch

from meshtrain.training.optimizer import FlatAdamW


class OuterOptimizer:
    """Round bookkeeping, the pseudo-gradient all-reduce and the outer Nesterov step of one rank."""

    def __init__(self, optimizer: FlatAdamW, mesh, sync_every: int, lr: float, momentum: float,
                 grad_dtype: str = "fp32"):
        """``optimizer``: the inner AdamW, whose fp32 master shards the outer step updates;
        ``mesh``: gives the ``replica`` comm; the rest as the config keys of the same names."""
        self.optimizer = optimizer
        self.engine = optimizer.engine
        self.shards = optimizer.shards
        self.comm = mesh.comm("replica")
        self.replicas = mesh.replicas
        self.sync_every = sync_every
        self.lr, self.momentum = lr, momentum
        self.grad_dtype = torch.bfloat16 if grad_dtype == "bf16" else torch.float32
        self.start = [shard.master.detach().clone() for shard in self.shards]
        """Start-of-round fp32 weights of each shard (the outer parameters)."""
        self.momentum_buf = [torch.zeros_like(shard.master) for shard in self.shards]
        self.rounds = 0
        """Outer steps taken."""

    def due(self, step: int, last_step: int) -> bool:
        """Whether the round ends after inner step ``step`` (1-based): every ``sync_every``
        steps, and at the run's last step so that every group ends with the same weights."""
        return step % self.sync_every == 0 or step == last_step

    @torch.no_grad()
    def sync(self) -> None:
        """Average the pseudo-gradients over the replica groups, take the outer step, and write
        the new weights into the masters, the parameters and the next round's start."""
        deltas = []
        for start, shard in zip(self.start, self.shards, strict=True):
            delta = start - shard.master
            deltas.append(delta if delta.dtype == self.grad_dtype else delta.to(self.grad_dtype))
        handles = [self.comm.all_reduce(d, async_op=True) for d in deltas]
        for handle in handles:
            if handle is not None:
                handle.wait()
        for start, shard, delta, buf in zip(self.start, self.shards, deltas, self.momentum_buf,
                                            strict=True):
            grad = delta.float().div_(self.replicas)
            if self.momentum:
                buf.mul_(self.momentum).add_(grad)
                grad.add_(buf, alpha=self.momentum)  # Nesterov: Δ̄ + μ b
            start.add_(grad, alpha=-self.lr)
            shard.master.copy_(start)
        self.engine.after_step(self.shards)
        self.rounds += 1

    @torch.no_grad()
    def restart_round(self) -> None:
        """Start a round from the current masters (after loading weights into them)."""
        for start, shard in zip(self.start, self.shards, strict=True):
            start.copy_(shard.master)

    def state_bytes(self) -> int:
        """Bytes of outer state this rank holds (start weights and momentum)."""
        return sum(t.numel() * t.element_size() for t in self.start + self.momentum_buf)
