"""What a data-parallel engine reports about itself: how its gradients are reduced, and whether
its replicas still agree (:class:`~meshtrain.parallel.data.engine.DataParallelEngine`)."""

from __future__ import annotations

import torch
import torch.distributed


def reduces_in_shared_memory(engine) -> bool:
    """True when at least one bucket's gradients are reduced through shared memory (ZeRO-3:
    its shards are gathered through it too, :mod:`.shared_shards`)."""
    if engine.stage == 3:
        return engine.shared_shards is not None
    return engine.stage < 2 and any(engine.comms[b.axis].shares(b.grad_buffer)
                                    for b in engine.buckets)


def reduction_summary(engine) -> str | None:
    """One line for the run's log on how dp gradients are reduced on CPU, and why not
    through shared memory when they are not; None without data parallelism or off CPU."""
    if not engine.comm.active or engine.buckets[0].device.type != "cpu":
        return None
    if reduces_in_shared_memory(engine):
        what = ("ZeRO-3 gathers and gradients go" if engine.stage == 3
                else "data-parallel gradients reduce")
        return f"{what} through shared memory ({engine.comm.size} ranks on one host)"
    if not engine.shared_memory_requested:
        reason = "parallel.dp_shared_memory = false"
    elif engine.stage == 2:
        reason = "ZeRO stage 2 reduces a fresh buffer each micro-batch"
    elif engine.stage == 3 and engine.offload is not None:
        reason = "ZeRO-3 shards are offloaded"
    elif not any(engine.shareable(b) for b in engine.buckets):
        reason = "shared memory takes fp32 buckets only"
    else:
        reason = "the ranks cannot map each other's memory: several hosts, or no /proc access"
    return f"data-parallel gradients reduce through gloo ({reason})"


@torch.no_grad()
def check_replicas_in_sync(engine) -> None:
    """Raise if any replicated parameter differs from its first replica's copy (dp rank 0,
    or edp rank 0 for expert buckets; a sanity check)."""
    if engine.stage == 3 or not engine.comm.active:
        return
    for b in engine.buckets:
        comm = engine.comms[b.axis]
        if not comm.active:
            continue
        reference = b.param_buffer.clone()
        comm.broadcast(reference, 0)
        diff_t = (reference - b.param_buffer).abs().max().reshape(1).float()
        comm.all_reduce(diff_t, op=torch.distributed.ReduceOp.MAX)  # every rank agrees
        diff = float(diff_t)
        if diff > 0:
            names = ", ".join(s.name for s in b.slots[:4])
            raise RuntimeError(f"data-parallel replicas diverged by {diff:.3e} in bucket "
                               f"{b.index} ({names}, ...)")
