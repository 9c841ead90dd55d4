"""Static checks of a schedule under NCCL's point-to-point semantics.

gloo matches a receive to a send by (peer, tag) and buffers sends, so a schedule that posts two
messages between the same pair of ranks in different orders on the two sides, or where two
neighbours both send first and wait, still runs on CPU. NCCL does neither:

* **Order.** Messages between an ordered pair of ranks are matched in the order they are issued;
  tags are ignored. Two messages of the same shape issued in different orders are silently
  swapped (an activation arrives where a gradient was expected).
* **Rendezvous.** A large send may block until the peer has posted the matching receive.
  Exchanges posted together in one batch (``torch.distributed.batch_isend_irecv``) progress
  together.

The executor posts every maximal run of consecutive send/recv actions of a rank's list as one
batch (see :func:`exchanges`); a received tensor is waited for before the compute that
consumes it (:mod:`.executor`). :func:`check_message_order`
proves the first rule and :func:`check_unbuffered` replays the lists under the second: a batch is
posted when its rank reaches it and completes once every one of its operations has its partner
posted on the other rank; compute waits for its inputs as in :mod:`.checker`.
"""

from __future__ import annotations

from meshtrain.parallel.pipeline.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    dependencies,
    produced_key,
)

K = ActionKind

# A message: ("act" | "grad", micro-batch, producing stage).
Message = tuple[str, int, int]


def message_of(action: Action) -> Message:
    """The message a send or recv action carries, named by its producing stage."""
    mb, s = action.microbatch, action.stage
    if action.kind is K.SEND_ACT:
        return ("act", mb, s)
    if action.kind is K.RECV_ACT:
        return ("act", mb, s - 1)
    if action.kind is K.SEND_GRAD:
        return ("grad", mb, s)
    if action.kind is K.RECV_GRAD:
        return ("grad", mb, s + 1)
    raise ValueError(f"{action} is not a communication action")


def exchanges(actions: list[Action]) -> list[tuple[int, list[Action]] | tuple[int, Action]]:
    """Split a rank's list into compute actions and batches of communication.

    Returns items ``(index, action)`` for a compute action and ``(index, [actions])`` for a
    maximal run of consecutive send/recv actions starting at ``index``: one batch, posted
    together and completed together.
    """
    items: list = []
    for i, a in enumerate(actions):
        if a.kind.is_compute:
            items.append((i, a))
        elif items and isinstance(items[-1][1], list):
            items[-1][1].append(a)
        else:
            items.append((i, [a]))
    return items


def check_message_order(schedule: Schedule) -> None:
    """Raise unless, for every ordered pair of ranks, the k-th message one sends is the k-th
    message the other receives (NCCL's matching: per pair, in issue order, no tags)."""
    for src in range(schedule.pp):
        for dst in range(schedule.pp):
            if src == dst:
                continue
            sends = [(i, a) for i, a in enumerate(schedule.actions[src])
                     if a.kind.is_send and a.peer == dst]
            recvs = [(j, a) for j, a in enumerate(schedule.actions[dst])
                     if a.kind.is_recv and a.peer == src]
            for k, ((i, send), (j, recv)) in enumerate(zip(sends, recvs, strict=False)):
                if message_of(send) != message_of(recv):
                    raise ScheduleError(
                        f"messages from rank {src} to rank {dst} are out of order: NCCL matches "
                        f"them per pair in issue order (tags are ignored), so rank {src}'s "
                        f"message #{k + 1}, {send} (action #{i}, micro-batch "
                        f"{send.microbatch}), would be delivered to rank {dst}'s receive "
                        f"#{k + 1}, {recv} (action #{j}, micro-batch {recv.microbatch}); "
                        f"post the receives on rank {dst} in the order rank {src} sends")


def check_unbuffered(schedule: Schedule) -> None:
    """Raise unless the lists complete when every send blocks until its receive is posted and
    each batch of consecutive communication actions completes together."""
    items = [exchanges(acts) for acts in schedule.actions]
    pos = [0] * schedule.pp
    done: set = set()
    posted_send: set[Message] = set()
    posted_recv: set[Message] = set()

    def unmatched(batch: list[Action]) -> list[Action]:
        return [a for a in batch
                if message_of(a) not in (posted_recv if a.kind.is_send else posted_send)]

    progress = True
    while progress:
        progress = False
        for rank in range(schedule.pp):
            while pos[rank] < len(items[rank]):
                _, item = items[rank][pos[rank]]
                if isinstance(item, list):
                    for a in item:
                        (posted_send if a.kind.is_send else posted_recv).add(message_of(a))
                    if unmatched(item):
                        break
                    done.update(produced_key(a) for a in item)
                elif any(d not in done for d in dependencies(schedule, rank, item)):
                    break
                else:
                    done.add(produced_key(item))
                pos[rank] += 1
                progress = True
    stuck = []
    for rank in range(schedule.pp):
        if pos[rank] == len(items[rank]):
            continue
        index, item = items[rank][pos[rank]]
        if isinstance(item, list):
            waits = ", ".join(f"{a} waits for rank {a.peer} to post its "
                              f"{'receive' if a.kind.is_send else 'send'}"
                              for a in unmatched(item))
            stuck.append(f"rank {rank} blocked in the exchange at action #{index} "
                         f"[{' '.join(str(a) for a in item)}]: {waits}")
        else:
            stuck.append(f"rank {rank} blocked at action #{index} {item}")
    if stuck:
        raise ScheduleError("deadlock when sends wait for their receives (NCCL rendezvous): "
                     + "; ".join(stuck) + "; post the two sides' sends and receives in one "
                     "exchange (consecutive actions) so they complete together")
