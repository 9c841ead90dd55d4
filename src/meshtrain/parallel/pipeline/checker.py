"""Static checks of a pipeline :class:`~.schedule.Schedule`: complete, matched, deadlock-free.

Semantics (shared with the simulator and the executor):

* sends are non-blocking: posted and buffered, they never wait;
* a ``RECV_*`` blocks until the peer has posted the matching send;
* ``F`` of stage ``s > 0`` needs its ``RECV_ACT`` (or this rank's ``F`` of ``s-1`` when both
  stages live on this rank);
* ``B``/``I`` of stage ``s`` needs that stage's ``F`` and, below the last stage, its
  ``RECV_GRAD`` (or this rank's ``B``/``I`` of ``s+1``);
* ``W`` needs its ``I``; a send needs the compute that produced its data.

:func:`execution_order` replays the lists under these rules, advancing any rank whose next action
is enabled; when no rank can advance it names each stuck rank and the action it waits on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from meshtrain.parallel.pipeline.message_order import check_message_order, check_unbuffered
from meshtrain.parallel.pipeline.schedule import (
    Action,
    ActionKind,
    Key,
    Schedule,
    ScheduleError,
    dependencies,
    produced_key,
)

K = ActionKind

def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank} action #{index} {action}"


def _check_actions_valid(schedule: Schedule) -> None:
    n, m = schedule.num_stages, schedule.microbatches
    if len(schedule.stage_to_rank) != n:
        raise ScheduleError(f"stage_to_rank has {len(schedule.stage_to_rank)} entries, expected "
                            f"pp × virtual_stages = {n}")
    if len(schedule.actions) != schedule.pp:
        raise ScheduleError(f"{len(schedule.actions)} action lists for pp = {schedule.pp}")
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if not 0 <= a.stage < n or not 0 <= a.microbatch < m:
                raise ScheduleError(f"{_where(rank, i, a)}: stage must be in [0, {n}) and "
                                    f"microbatch in [0, {m})")
            if schedule.stage_to_rank[a.stage] != rank:
                raise ScheduleError(f"{_where(rank, i, a)}: stage {a.stage} is held by rank "
                                    f"{schedule.stage_to_rank[a.stage]}, not rank {rank}")
            if a.kind.is_compute and a.peer is not None:
                raise ScheduleError(f"{_where(rank, i, a)}: compute actions take no peer")


def _check_compute(schedule: Schedule) -> None:
    """Every (microbatch, stage) forwarded once and backwarded once, in a sane order."""
    for rank, acts in enumerate(schedule.actions):
        position: dict[tuple[str, int, int], int] = {}
        counts: Counter = Counter()
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                counts[(a.kind.value, a.microbatch, a.stage)] += 1
                position.setdefault((a.kind.value, a.microbatch, a.stage), i)
        for (kind, mb, s), c in counts.items():
            if c > 1:
                a = acts[position[(kind, mb, s)]]
                raise ScheduleError(f"rank {rank}: {a} appears {c} times")
        for s in schedule.stages_of(rank):
            for mb in range(schedule.microbatches):
                what = f"rank {rank}: micro-batch {mb} on stage {s}"
                f, b = position.get(("F", mb, s)), position.get(("B", mb, s))
                i, w = position.get(("I", mb, s)), position.get(("W", mb, s))
                if f is None:
                    raise ScheduleError(f"{what} is never forwarded (no F{mb}@s{s})")
                if b is not None and (i is not None or w is not None):
                    raise ScheduleError(f"{what} has both B and I/W; use one B, or one I and "
                                        "one W")
                if b is None and i is None:
                    raise ScheduleError(f"{what} is never backwarded (expected one B{mb}@s{s}, "
                                        f"or one I{mb}@s{s} and one W{mb}@s{s})")
                if b is None and w is None:
                    raise ScheduleError(f"{what} has I{mb}@s{s} but no W{mb}@s{s}")
                if i is None and w is not None:
                    raise ScheduleError(f"{what} has W{mb}@s{s} but no I{mb}@s{s}")
                back = b if b is not None else i
                if back < f:
                    raise ScheduleError(f"{_where(rank, back, acts[back])}: backward before its "
                                        f"forward F{mb}@s{s} (action #{f})")
                if w is not None and w < i:
                    raise ScheduleError(f"{_where(rank, w, acts[w])}: W before its I (action "
                                        f"#{i})")


def _expected_comm(schedule: Schedule) -> set[tuple[int, Action]]:
    """Every (rank, send/recv action) the placement requires."""
    to_rank, last = schedule.stage_to_rank, schedule.last_stage
    out: set[tuple[int, Action]] = set()
    for s in range(last):
        src, dst = to_rank[s], to_rank[s + 1]
        if src == dst:
            continue
        for mb in range(schedule.microbatches):
            out.add((src, Action(K.SEND_ACT, mb, s, dst)))
            out.add((dst, Action(K.RECV_ACT, mb, s + 1, src)))
            out.add((dst, Action(K.SEND_GRAD, mb, s + 1, src)))
            out.add((src, Action(K.RECV_GRAD, mb, s, dst)))
    return out


def _check_comm(schedule: Schedule) -> None:
    """Each cross-rank edge has exactly one send and one matching recv per direction."""
    expected = _expected_comm(schedule)
    seen: Counter = Counter()
    for rank, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind.is_compute:
                continue
            seen[(rank, a)] += 1
            if seen[(rank, a)] > 1:
                raise ScheduleError(f"{_where(rank, i, a)}: duplicated")
            if (rank, a) in expected:
                continue
            reason = _comm_problem(schedule, rank, a)
            raise ScheduleError(f"{_where(rank, i, a)}: unexpected; {reason}")
    for rank, a in sorted(expected - set(seen), key=lambda x: (x[0], str(x[1]))):
        peer_action = _partner(schedule, a)
        raise ScheduleError(f"rank {rank} lacks {a}, the other half of {peer_action} on rank "
                            f"{a.peer}")


def _comm_problem(schedule: Schedule, rank: int, a: Action) -> str:
    """Why a send/recv that the placement does not require is wrong."""
    step = 1 if a.kind in (K.SEND_ACT, K.RECV_GRAD) else -1
    other = a.stage + step
    if not 0 <= other < schedule.num_stages:
        return f"stage {a.stage} has no neighbour stage {other}"
    other_rank = schedule.stage_to_rank[other]
    if other_rank == rank:
        return (f"stages {a.stage} and {other} are both on rank {rank}; data between them is "
                "handed over in memory")
    return f"wrong peer {a.peer}: stage {other} is on rank {other_rank}"


def _partner(schedule: Schedule, a: Action) -> Action:
    rank = schedule.stage_to_rank[a.stage]
    if a.kind is K.SEND_ACT:
        return Action(K.RECV_ACT, a.microbatch, a.stage + 1, rank)
    if a.kind is K.RECV_ACT:
        return Action(K.SEND_ACT, a.microbatch, a.stage - 1, rank)
    if a.kind is K.SEND_GRAD:
        return Action(K.RECV_GRAD, a.microbatch, a.stage - 1, rank)
    return Action(K.SEND_GRAD, a.microbatch, a.stage + 1, rank)


def execution_order(schedule: Schedule) -> Iterator[tuple[int, Action]]:
    """Yield ``(rank, action)`` in an order every rank's list allows; raise on deadlock.

    Each yielded action's dependencies were all yielded before it. Assumes the structural checks
    of :func:`check_schedule` passed (otherwise a missing producer shows up as a deadlock).
    """
    done: set[Key] = set()
    pos = [0] * schedule.pp
    waiting: dict[Key, list[int]] = {}  # missing key -> ranks blocked on it
    runnable = list(range(schedule.pp))
    while runnable:
        rank = runnable.pop()
        acts = schedule.actions[rank]
        while pos[rank] < len(acts):
            act = acts[pos[rank]]
            missing = next((d for d in dependencies(schedule, rank, act) if d not in done), None)
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                break
            key = produced_key(act)
            done.add(key)
            runnable.extend(waiting.pop(key, ()))
            pos[rank] += 1
            yield rank, act
    stuck = []
    for rank, acts in enumerate(schedule.actions):
        if pos[rank] < len(acts):
            act = acts[pos[rank]]
            waits = [d for d in dependencies(schedule, rank, act) if d not in done]
            stuck.append(f"rank {rank} blocked at action #{pos[rank]} {act} waiting for "
                         + ", ".join(_describe(d) for d in waits))
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))


def _describe(key: Key) -> str:
    kind, mb, s = key
    return f"{kind}{mb}@s{s}"


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, matched and deadlock-free.

    Checks, in order: actions name valid stages held by their rank; every (micro-batch, stage) is
    forwarded exactly once and backwarded exactly once (one ``B``, or one ``I`` then one ``W``)
    after its forward; every cross-rank transfer has exactly one send and one matching recv with
    the right peer and nothing else is sent; sends follow the compute producing their data; and
    replaying the lists under the blocking semantics finishes.
    """
    _check_actions_valid(schedule)
    _check_compute(schedule)
    _check_comm(schedule)
    for rank, acts in enumerate(schedule.actions):
        index = {produced_key(a): i for i, a in enumerate(acts)}
        for i, a in enumerate(acts):
            if a.kind.is_send:
                (dep,) = dependencies(schedule, rank, a)
                if index.get(dep, len(acts)) > i:
                    raise ScheduleError(f"{_where(rank, i, a)}: sent before "
                                        f"{_describe(dep)} produced its data")
    for _ in execution_order(schedule):
        pass
    check_message_order(schedule)
    check_unbuffered(schedule)
