"""Moving experts between expert-parallel ranks: parameters and fp32 optimizer state, ZeRO 0-3.

Under expert parallelism the ``E/ep`` local experts of a layer are rows of its 3-D expert
parameters (``w1``, ``w2``, ``w3`` ``[E/ep, ...]``), which the data-parallel engine flattens into
``edp`` buckets. Every rank of one ``dp_tp`` group (the ``dp × tp`` ranks of one pipeline stage,
which the expert groups factor, :mod:`meshtrain.parallel.mesh`) builds the same bucket layout for
these parameters, since all ep ranks hold the same shapes; "dp rank" below is the place in that
group. What an optimizer shard holds (fp32 master, Adam ``exp_avg``, ``exp_avg_sq``) is:

* ZeRO stage 0: the whole bucket, replicated over the ``dp·tp/ep`` edp ranks of each ep rank;
* ZeRO stages 1-3: the flat range ``[e·S, (e+1)·S)`` of the bucket for edp rank ``e`` (at
  stage 3 the fp32 master is the parameter shard itself, and a bucket holds one MoE unit's
  experts).

A new placement says, for every slot ``(ep rank b, local index k)``, which expert sits there; the
expert came from an old slot ``(a, j)``. Every element of the destination's share of slot
``(b, k)`` is found at the same expert-relative position of slot ``(a, j)`` in the source's
bucket; under ZeRO that position may belong to *another* edp rank's shard (when ``j != k`` the
expert's rows shift against the shard boundaries), so a move is in general an exchange over the
whole dp group (dp rank = ``edp_rank · ep + ep_rank``). :func:`plan_moves` lists the contiguous
runs (:class:`Segment`) of every such transfer; every rank computes the same list from the old
and new placements, so both ends agree on the order of the rows without any negotiation, and
:func:`move_expert_state` ships all of them in **one** ``all_to_all_single`` of fp32 values over
``dp`` (master, ``exp_avg`` and ``exp_avg_sq`` of each run side by side). Slots whose expert does
not change send nothing; at stage 0 each replica is refreshed from the replica with its own edp
index. The parameters are then rewritten from the masters as after an optimizer step (an
all-gather over edp of the changed buckets under ZeRO 1-2; under ZeRO-3 the next gather
assembles them). Gradients are not moved: moves happen
between steps, when they are zero.
"""

from __future__ import annotations

import dataclasses

import torch

from meshtrain.parallel.comm import CountedComm


@dataclasses.dataclass(frozen=True)
class Segment:
    """``length`` consecutive elements of optimizer shard ``shard`` that go from dp rank ``src``
    (at ``src_at`` in its shard) to dp rank ``dst`` (at ``dst_at`` in its shard)."""

    shard: int
    src: int
    src_at: int
    dst: int
    dst_at: int
    length: int


def param_segments(shard: int, offset: int, per_expert: int, old: list[int], new: list[int],
                   ep: int, edp: int, shard_numel: int | None) -> list[Segment]:
    """The transfers that bring one expert parameter from placement ``old`` to ``new``.

    ``offset``: where the parameter starts in its bucket; ``per_expert``: elements per expert
    (one row of the ``[E/ep, ...]`` parameter); ``shard_numel``: the ZeRO shard size ``S`` of
    the bucket, or None at stage 0 (every rank holds the whole bucket). Placements are lists
    slot -> expert over the ``E`` slots; slot ``s`` is ep rank ``s // (E/ep)``, local index
    ``s % (E/ep)``. Segments are listed by destination dp rank, then local index, then position.
    """
    local = len(old) // ep
    slot_of = {expert: slot for slot, expert in enumerate(old)}
    out: list[Segment] = []
    for dst in range(ep * edp):
        dst_ep, dst_edp = dst % ep, dst // ep
        base = dst_edp * shard_numel if shard_numel is not None else 0
        hi = base + shard_numel if shard_numel is not None else None
        for k in range(local):
            new_slot = dst_ep * local + k
            old_slot = slot_of[new[new_slot]]
            if old_slot == new_slot:
                continue
            src_ep, j = divmod(old_slot, local)
            start = offset + k * per_expert  # the destination row in bucket coordinates
            lo_p = max(start, base) - start
            hi_p = (min(start + per_expert, hi) if hi is not None else start + per_expert) - start
            p = lo_p
            while p < hi_p:
                q = offset + j * per_expert + p  # the same element in the source's bucket
                if shard_numel is None:
                    src_edp, src_base, stop = dst_edp, 0, hi_p
                else:
                    src_edp = q // shard_numel
                    src_base = src_edp * shard_numel
                    stop = min(hi_p, p + src_base + shard_numel - q)
                out.append(Segment(shard, src_edp * ep + src_ep, q - src_base, dst,
                                   start + p - base, stop - p))
                p = stop
    return out


def plan_moves(shards, shardings, changes: dict[int, list[int]], ep: int, edp: int,
               sharded: bool) -> list[Segment]:
    """Every transfer of every expert bucket for the placement ``changes`` (``id`` of a
    :class:`~meshtrain.parallel.expert.placement.LayerPlacement` -> its new slots);
    ``shardings``: the model's :class:`~meshtrain.parallel.sharding.ShardingTable`, which
    gives each expert parameter's placement."""
    segments: list[Segment] = []
    for index, shard in enumerate(shards):
        bucket = shard.bucket
        if bucket.axis != "edp":
            continue
        for slot in bucket.slots:
            placement = shardings[slot.name].expert_placement
            if placement is None or id(placement) not in changes:
                continue
            per_expert = slot.numel // slot.shape[0]
            segments += param_segments(index, slot.offset, per_expert, placement.slots,
                                       changes[id(placement)], ep, edp,
                                       bucket.shard_numel if sharded else None)
    return segments


@torch.no_grad()
def move_expert_state(engine, optimizer, comm: CountedComm, dp_rank: int, ep: int,
                      changes: dict[int, list[int]]) -> int:
    """Move the fp32 masters and Adam moments of the changed experts to their new slots (a
    collective over ``comm`` = the ``dp_tp`` group, ``dp_rank`` = this rank's place in it; every
    rank of it calls with the same ``changes``),
    then refresh the parameters of the touched buckets. Returns the elements this rank received.
    """
    dp = max(comm.size, 1)
    segments = plan_moves(optimizer.shards, engine.shardings, changes, ep, dp // ep,
                          engine.stage >= 1)
    if not segments:
        return 0
    states = [(shard.master, m, v) for shard, m, v in zip(optimizer.shards, optimizer.exp_avg,
                                                          optimizer.exp_avg_sq, strict=True)]
    sends = sorted((s for s in segments if s.src == dp_rank), key=lambda s: s.dst)
    recvs = sorted((s for s in segments if s.dst == dp_rank), key=lambda s: s.src)
    device = engine.buckets[0].device  # offloaded state lives on the host: sent from here
    pieces = [torch.stack([t[s.src_at:s.src_at + s.length] for t in states[s.shard]])
              for s in sends]
    send = (torch.cat([p.reshape(-1) for p in pieces]).to(device) if pieces
            else torch.zeros(0, device=device))
    input_splits = [3 * sum(s.length for s in sends if s.dst == r) for r in range(dp)]
    output_splits = [3 * sum(s.length for s in recvs if s.src == r) for r in range(dp)]
    received = torch.empty(sum(output_splits), dtype=torch.float32, device=device)
    comm.all_to_all_single(received, send, output_splits, input_splits)
    at = 0
    for s in recvs:
        block = received[at:at + 3 * s.length].view(3, s.length)
        for t, values in zip(states[s.shard], block, strict=True):
            t[s.dst_at:s.dst_at + s.length].copy_(values)
        at += 3 * s.length
    touched = sorted({s.shard for s in segments})
    engine.after_step([optimizer.shards[i] for i in touched])
    if engine.offload is not None:  # the moved offloaded state leaves memory again
        engine.offload.release_all()
    return received.numel()
